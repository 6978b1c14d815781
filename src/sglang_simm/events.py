"""What L3 gains and loses, announced as SGLang KV events off the request path.

``L3Events`` is what the backend's data path calls: it only appends page
keys to a queue bounded in pages (a full queue drops, counted); one thread
of ours turns them into SGLang's own events (``BlockStored``,
``BlockRemoved`` in ``KVEventBatch``es) for SGLang's publisher. Which
pages, under which hash, and why: docs/kv-events.md. The remembered pages
are a dict only the publishing thread writes; the data path reads it
without a lock (``key in dict`` is one atomic step).
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sglang_simm.metrics import RateLimitedLog

__all__ = ["MAX_BATCH_PAGES", "NO_EVENTS", "L3Events", "NoEvents", "event_hash"]

logger = logging.getLogger("sglang_simm.events")

#: pages per ``KVEventBatch`` at most: a batch is one ZMQ message, kept by
#: ZMQ for a slow subscriber (``hwm``) and by the replay buffer, so its size
#: bounds their memory
MAX_BATCH_PAGES = 512

#: block hashes per ``BlockRemoved`` when everything remembered goes at once
REMOVED_CHUNK = 4096

#: how long ``close`` waits for the queue to be published
CLOSE_WAIT_S = 2.0

_STORED, _MISSED, _REMOVED, _CLEARED = "stored", "missed", "removed", "cleared"


def event_hash(page_key: str) -> int:
    """SGLang's event hash of a page key (``mem_cache/utils.py``
    ``hash_str_to_int64``): its first 16 hex digits as a signed int64.
    ValueError for a key that does not start with 16 hex digits."""
    if len(page_key) < 16:
        raise ValueError(f"page key {page_key!r} is shorter than 16 hex digits")
    value = int(page_key[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def _never_raises(method):
    """A data-path entry point: whatever goes wrong in it is logged
    (rate-limited) and dropped, never raised into the backend's call, whose
    answer to SGLang must not change because of an event."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self._warn("kv_events", "sglang-simm kv_events: %s failed (%s: %s); its events are lost",
                       method.__name__, type(exc).__name__, exc)
    return wrapper


class _Item(NamedTuple):
    kind: str
    keys: list[str]
    parent: str | None = None
    page_size: int = 0


class NoEvents:
    """Events off: every call does nothing, so the data path never asks."""

    on = False

    def stored(self, page_keys: Sequence[Any], ok: Sequence[bool], prefix_keys: Sequence[str] | None,
               page_size: int) -> None:
        pass

    def missed(self, page_keys: Iterable[Any]) -> None:
        pass

    def removed(self, page_keys: Iterable[Any]) -> None:
        pass

    def cleared(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


NO_EVENTS = NoEvents()


class L3Events(NoEvents):
    """One server's L3 event stream: a bounded queue, the remembered pages,
    and a thread handing SGLang's publisher one ``KVEventBatch`` at a time.

    ``publisher``: SGLang's ``EventPublisher`` (``publish(batch)``,
    ``shutdown()``); ``medium``: every event's (a ``StorageMedium``).
    """

    on = True

    def __init__(self, publisher: Any, *, medium: Any, max_queue_pages: int, remember_pages: int) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch

        self._block_stored, self._block_removed, self._batch = BlockStored, BlockRemoved, KVEventBatch
        self._publisher = publisher
        self.medium = medium
        self.max_queue_pages = max_queue_pages
        self.remember_pages = remember_pages
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._queued = 0
        self._closing = False
        #: the thread holds items taken off the queue and not yet published
        self._busy = False
        #: page key -> None, oldest first; written by the publishing thread only
        self._remembered: OrderedDict[str, None] = OrderedDict()
        self._warned_parents = False
        self._count_lock = threading.Lock()
        self.stored_pages = self.removed_pages = self.batches = 0
        self.dropped = {_STORED: 0, _REMOVED: 0}
        #: one warning per 10 s at most: a failure repeats on every call
        self._warn = RateLimitedLog(logger)
        self._thread = threading.Thread(target=self._run, name="sglang-simm-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the data path

    @_never_raises
    def stored(self, page_keys: Sequence[Any], ok: Sequence[bool], prefix_keys: Sequence[str] | None,
               page_size: int) -> None:
        """The store confirmed ``page_keys`` where ``ok``: announce the
        leading run. ``prefix_keys``: SGLang's keys of the pages before
        them (``HiCacheStorageExtraInfo.prefix_keys``; None when SGLang's
        ``hicache_storage_pass_prefix_keys`` is off)."""
        n = next((i for i, good in enumerate(ok) if not good), len(ok))
        if not n:
            return
        if prefix_keys is None and not self._warned_parents:
            self._warned_parents = True
            logger.info("sglang-simm kv_events: SGLang passes no prefix keys, so the first page of each backup "
                        "is announced with parent_block_hash null; add \"hicache_storage_pass_prefix_keys\": true "
                        "to --hicache-storage-backend-extra-config for the parents SGLang's own events carry")
        parent = prefix_keys[-1] if prefix_keys else None
        self._put(_Item(_STORED, list(page_keys[:n]), parent, page_size), n)

    @_never_raises
    def missed(self, page_keys: Iterable[Any]) -> None:
        """The store answered "not there" for ``page_keys`` (a lookup or a
        read): announce the removal of those this server announced."""
        remembered = self._remembered
        gone = [k for k in page_keys if k in remembered]
        if gone:
            self._put(_Item(_MISSED, gone), len(gone))

    @_never_raises
    def removed(self, page_keys: Iterable[Any]) -> None:
        """``page_keys`` left the store (evicted, deleted, overwritten by
        other bytes): announce their removal."""
        keys = list(page_keys)
        if keys:
            self._put(_Item(_REMOVED, keys), len(keys))

    @_never_raises
    def cleared(self) -> None:
        """Everything this server stored is gone: announce the removal of
        every page it remembers."""
        self._put(_Item(_CLEARED, []), 1)

    def _put(self, item: _Item, pages: int) -> None:
        with self._cond:
            if self._closing or self._queued + pages > self.max_queue_pages:
                kind = _STORED if item.kind == _STORED else _REMOVED
                with self._count_lock:
                    self.dropped[kind] += pages
                return
            self._queue.append(item)
            self._queued += pages
            self._cond.notify()

    # ------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if not self._queue:
                        break
                    items, pages = [], 0
                    while self._queue and pages < MAX_BATCH_PAGES:
                        item = self._queue.popleft()
                        n = len(item.keys) or 1
                        items.append(item)
                        pages += n
                    self._queued -= pages
                    self._busy = True
                try:
                    self._publish(self._events_of(items))
                finally:
                    with self._cond:
                        self._busy = False
            # Closing: this server reads none of it any more.
            gone = list(self._remembered)
            self._remembered.clear()
            for i in range(0, len(gone), REMOVED_CHUNK):
                self._publish(self._removals(gone[i:i + REMOVED_CHUNK]))
        except Exception:  # never seen; the stream stops, serving goes on
            logger.exception("sglang-simm kv_events: the publishing thread failed; no more L3 events")
        finally:
            try:
                self._publisher.shutdown()
                # SGLang's publisher also shuts itself down at exit; a second
                # shutdown waits a second on a queue no thread reads any more
                atexit.unregister(self._publisher.shutdown)
            except Exception as exc:
                logger.warning("sglang-simm kv_events: closing SGLang's publisher: %s: %s", type(exc).__name__, exc)

    def _events_of(self, items: list[_Item]) -> list[Any]:
        events: list[Any] = []
        remembered = self._remembered
        for item in items:
            if item.kind == _STORED:
                events += self._stores(item)
            elif item.kind == _CLEARED:
                gone = list(remembered)
                remembered.clear()
                events += self._removals(gone)
            else:
                # a page missed twice before its first removal went out is announced once
                gone = [k for k in item.keys if remembered.pop(k, 0) is None or item.kind == _REMOVED]
                events += self._removals(gone)
        return events

    def _stores(self, item: _Item) -> list[Any]:
        """One ``BlockStored`` per page, each chained to the one before;
        remembers the pages (forgetting, and announcing removed, the oldest
        past ``remember_pages``)."""
        out: list[Any] = []
        parent = _hash_or_none(item.parent)
        remembered, limit = self._remembered, self.remember_pages
        forgotten: list[str] = []
        for key in item.keys:
            block = _hash_or_none(key)
            if block is None:  # not a hex page hash: no event of SGLang's names it; its children lose the link
                parent = None
                continue
            out.append(self._block_stored(block_hashes=[block], parent_block_hash=parent, token_ids=[],
                                          block_size=item.page_size, lora_id=None, medium=self.medium))
            parent = block
            if limit:
                remembered[key] = None
                remembered.move_to_end(key)
                if len(remembered) > limit:
                    forgotten.append(remembered.popitem(last=False)[0])
        return out + self._removals(forgotten)

    def _removals(self, keys: list[str]) -> list[Any]:
        hashes = [h for h in map(_hash_or_none, keys) if h is not None]
        if not hashes:
            return []
        return [self._block_removed(block_hashes=hashes, medium=self.medium)]

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        stored = sum(1 for e in events if isinstance(e, self._block_stored))
        removed = sum(len(e.block_hashes) for e in events if isinstance(e, self._block_removed))
        try:
            self._publisher.publish(self._batch(ts=time.time(), events=events))
        except Exception as exc:
            with self._count_lock:
                self.dropped[_STORED] += stored
                self.dropped[_REMOVED] += removed
            self._warn("kv_events", "sglang-simm kv_events: SGLang's publisher refused a batch (%s: %s); "
                       "its pages are counted as dropped", type(exc).__name__, exc)
            return
        with self._count_lock:
            self.batches += 1
            self.stored_pages += stored
            self.removed_pages += removed

    # ------------------------------------------------------------ the rest

    def snapshot(self) -> dict[str, Any]:
        """Pages announced and dropped, batches published, and what waits."""
        with self._count_lock:
            return {"stored_pages": self.stored_pages, "removed_pages": self.removed_pages,
                    "dropped_pages": dict(self.dropped), "batches": self.batches,
                    "queued_pages": self._queued, "remembered_pages": len(self._remembered)}

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far has been handed to SGLang's
        publisher (tests, benches); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if not self._queue and not self._busy:
                    return True
            time.sleep(0.005)
        return False

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Publish what is queued and the removal of every page remembered
        (this server reads none of them any more), then close SGLang's
        publisher; waits up to ``wait_s``, then leaves it to the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(wait_s)


def _hash_or_none(key: str | None) -> int | None:
    if key is None:
        return None
    try:
        return event_hash(key)
    except (TypeError, ValueError):
        return None
