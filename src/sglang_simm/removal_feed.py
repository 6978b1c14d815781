"""What the local store removed, fed to this backend's KV events.

One thread per publishing backend asks the local store for its recent
removals (``Store.removed_since``) every ``POLL_S`` and hands them to
``HiCacheSiMM.l3_removed`` / ``l3_cleared``, so that what another server
or ``store clear`` made leave is announced too (docs/kv-events.md, "The
store's removal channel"). SiMM's client has no such call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sglang_simm.metrics import RateLimitedLog

logger = logging.getLogger("sglang_simm.events")

POLL_S = 0.5


class RemovalFeed:
    """Polls ``removed_since`` on a thread of its own until ``close``."""

    def __init__(self, removed_since: Callable[[Any], tuple[Any, bool, list[str], list[str]]],
                 removed: Callable[[list[str]], None], cleared: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self._removed_since, self._removed, self._cleared = removed_since, removed, cleared
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._warn = RateLimitedLog(logger, interval=60.0)
        self._thread = threading.Thread(target=self._run, name="sglang-simm-removals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cursor = None  # the first answer: from now, before this backend has announced anything
        while True:
            while True:  # the cursor moved: ask again at once, until an answer brings nothing new
                try:
                    before = cursor
                    cursor, lost, keys, prefixes = self._removed_since(cursor)
                    for prefix in [""] if lost else prefixes:
                        self._cleared(prefix)
                    if keys:
                        self._removed(keys)
                except Exception as exc:  # the store's faults are counted on the data path
                    self._warn("removals", "sglang-simm kv_events: asking the store what it removed failed "
                               "(%s: %s)", type(exc).__name__, exc)
                    break
                if before is None or cursor == before or self._stop.is_set():
                    break
            if self._stop.wait(self.poll_s):
                return

    def close(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(wait_s)
