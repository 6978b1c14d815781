"""What the local store removed, fed to this backend's KV events.

Every server that shares a store must announce what leaves it, whoever
made it leave: an eviction for another server's put, a ``store clear``.
The local store keeps its recent removals (``Store.removed_since``); one
thread per publishing backend asks for them every ``POLL_S`` and hands
them to ``HiCacheSiMM.l3_removed`` / ``l3_cleared``. A key stored again by
the time it is asked for is not reported (it is there), so a removal never
follows the newer announcement of the same page. SiMM's client has no such
call: on a cluster, removals are announced from misses only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("sglang_simm.events")

POLL_S = 0.5


class RemovalFeed:
    """Polls ``removed_since`` on a thread of its own until ``close``."""

    def __init__(self, removed_since: Callable[[Any], tuple[Any, bool, list[str], list[str]]],
                 removed: Callable[[list[str]], None], cleared: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self._removed_since, self._removed, self._cleared = removed_since, removed, cleared
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="sglang-simm-removals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cursor = None  # the first answer: from now, before this backend has announced anything
        while True:
            while True:  # a full answer: ask again at once
                try:
                    before = cursor
                    cursor, lost, keys, prefixes = self._removed_since(cursor)
                    for prefix in [""] if lost else prefixes:
                        self._cleared(prefix)
                    if keys:
                        self._removed(keys)
                except Exception as exc:  # the store's faults are counted on the data path
                    if time.monotonic() - self._last_warning > 60:
                        self._last_warning = time.monotonic()
                        logger.warning("sglang-simm kv_events: asking the store what it removed failed (%s: %s)",
                                       type(exc).__name__, exc)
                    break
                if before is None or cursor == before or self._stop.is_set():
                    break
            if self._stop.wait(self.poll_s):
                return

    def close(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(wait_s)
