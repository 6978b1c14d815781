"""The shared state of one in-process local store: the "data server".

**Invariant: a reader copies a whole published value, old or new, never a
torn or foreign one; bytes an in-flight reader is copying are never reused
until it releases them; and the store's memory stays within its capacity
plus the index's slack (``_arena.arena_bytes_for``).** Every path below
keeps it, by asking the index in this order:

* a put reserves room (``StoreIndex.begin_put``: evicting as needed, the
  extents nobody else can see until published), copies the caller's bytes
  into the arena *outside* the lock, then publishes (``commit_put``); a put
  that fails publishes nothing and leaves the key's value alone;
* a get pins the objects (``begin_get``), copies them out outside the lock,
  then unpins them (``release``); an object deleted, overwritten or evicted
  meanwhile leaves the index at once but keeps its extent until the last
  pin goes, so no put is handed its bytes;
* the arena is the index's size, so what the index hands out bounds the
  memory; ``clear`` and ``set_capacity`` give free extents' memory back.

An :class:`EmbeddedServer` is the same store as the store process
(``_daemon``), inside this process: one :class:`~._index.StoreIndex` holds
its keys, capacity, reservations, FIFO or LRU eviction and counters, by
the same rules, and this class keeps only what is its own: the arena in
this process's memory (``_private_arena``), the lock around the index, and
the copies. The index itself, not a part drawn out of it: it is pure
bookkeeping already (no I/O, no threads; its crash table and lease table
are optional), and a class drawn out of it would split one set of rules
(room, leases, pins, eviction) over two. It is driven as the store process
drives it: one owner (``connect``), as one client process's connection is
there, with no crash table (a process's store dies with it, ``_NoTable``)
and so no takeover (``restore``). Its limits are the store process's, but
for the share of the capacity an owner's puts may hold (a share keeps a
stopped client from holding the store; here the one owner is the process
itself, so its puts reserve up to the capacity) and the leases one owner
may hold (``MAX_CALLS_IN_FLIGHT``, the calls of all threads at once).

Clients (``Store()``) are thin; several share one server by name through
the process-wide registry at the bottom of this module. It speaks the data
server's codes (``DS_KEY_NOT_FOUND``, ``DS_DATA_ALREADY_EXISTS``,
``DS_CACHE_POOL_ALLOC_FAILED``, ``OUT_OF_MEMORY``, and ``INVALID_ARGUMENT``
for a reader's buffer smaller than the object); the client maps them
exactly as the real client does on each path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from sglang_simm.embedded._arena import arena_bytes_for
from sglang_simm.embedded._copy import copy_many, human_bytes, wrap_memory  # noqa: F401 (wrap_memory re-exported)
from sglang_simm.embedded._index import STAT_NAMES, StoreIndex, check_capacity
from sglang_simm.embedded._limits import StoreLimits
from sglang_simm.embedded._private_arena import PrivateArena

logger = logging.getLogger("sglang_simm.embedded")

#: Calls (of all threads) the store serves at once, each under one lease;
#: one more is answered as the store process answers past its lease limits
#: (a get TARGET_UNAVAILABLE, a put DS_CACHE_POOL_ALLOC_FAILED). A process's
#: threads are far fewer; the lease table costs 48 bytes a lease.
MAX_CALLS_IN_FLIGHT = 4096
#: The one owner of every lease: this process.
_OWNER = 1


def _key(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


# -- the server --------------------------------------------------------------


class EmbeddedServer:
    """Objects in this process's memory, a byte capacity, eviction, one lock.

    ``policy`` "fifo" (SiMM's data server: no access bit) evicts the oldest
    put first; "lru" also counts a get as use. ``exists`` never does.
    """

    def __init__(self, name: str, capacity_bytes: int, policy: str = "fifo") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._arena = PrivateArena(arena_bytes_for(check_capacity(capacity_bytes)))
        limits = StoreLimits(max_leases=MAX_CALLS_IN_FLIGHT, max_leases_per_connection=MAX_CALLS_IN_FLIGHT)
        self._index = StoreIndex(capacity=capacity_bytes, arena_bytes=self._arena.size, policy=policy,
                                 commit=self._arena.commit, limits=limits, held_share=None)
        # start time 0: nothing reaps an owner here (its process is this one)
        self._index.connect(_OWNER, os.getpid(), 0)

    # -- capacity ---------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity

    @property
    def used_bytes(self) -> int:
        return self._index.used

    @property
    def policy(self) -> str:
        return self._index.policy

    def set_policy(self, policy: str) -> None:
        """Evict "fifo" (oldest put first) or "lru" (least recently used) from now on."""
        with self._lock:
            self._index.set_policy(policy)

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the capacity now, evicting the next to evict until the
        stored bytes fit, and give the memory freed back. TypeError or
        ValueError for a bad ``capacity_bytes``, or one above what the
        store's arena holds (the capacity it was made with, plus slack)."""
        with self._lock:
            self._index.set_capacity(capacity_bytes)
            self._release_free_locked()

    def add_warmup_prefix(self, prefix: str) -> None:
        """Count keys that start with ``prefix`` apart from now on, as well
        (``warmup_puts``, ``warmup_hits``); ValueError for an empty or
        too long prefix, or one too many."""
        raw = _key(prefix) if isinstance(prefix, str) else prefix
        with self._lock:
            self._index.add_warmup_prefix(raw)

    def _release_free_locked(self) -> None:
        """Give back the memory of every free extent (under the lock: the
        index hands none of them out meanwhile)."""
        self._arena.release(self._index.alloc.free_extents())

    # -- data path (server codes) -------------------------------------------

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        """Store ``(key, ptr, size)`` entries, copying from ``ptr``.

        Per entry: OK; ``DS_DATA_ALREADY_EXISTS`` when the key is there and
        ``overwrite`` is false; ``DS_CACHE_POOL_ALLOC_FAILED`` when the object
        cannot fit; ``OUT_OF_MEMORY`` when the host cannot commit its memory.
        """
        keys = [_key(key) for key, _, _ in items]
        sizes = [size for _, _, size in items]
        index = self._index
        with self._lock:
            lease, codes, offsets = index.begin_put(_OWNER, keys, sizes, overwrite)
        if not lease:
            return codes
        base = self._arena.base
        try:
            copy_many([(base + offset, ptr, size) for (_, ptr, size), offset in zip(items, offsets) if offset >= 0])
        except BaseException:
            with self._lock:
                index.release(lease, _OWNER)  # aborted: nothing published, the room comes back
            raise
        with self._lock:
            done = index.commit_put(lease, _OWNER)
        for i, code in done:
            codes[i] = code
        return codes

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        """Copy objects into ``(key, ptr, capacity)`` buffers.

        Per entry: the object's size; ``DS_KEY_NOT_FOUND``; or
        ``INVALID_ARGUMENT`` when the buffer is smaller than the object.
        """
        keys = [_key(key) for key, _, _ in items]
        capacities = [capacity for _, _, capacity in items]
        index = self._index
        with self._lock:
            lease, results, offsets = index.begin_get(_OWNER, keys, capacities)
        if not lease:
            return results
        base = self._arena.base
        try:
            copy_many([(ptr, base + offset, size)
                       for (_, ptr, _), offset, size in zip(items, offsets, results) if offset >= 0])
        finally:
            with self._lock:
                index.release(lease, _OWNER)
        return results

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """Per key, OK or ``DS_KEY_NOT_FOUND``; eviction order is left alone."""
        raw = [_key(key) for key in keys]
        with self._lock:
            return self._index.lookup(raw)

    def delete(self, key: str) -> int:
        """OK, or ``DS_KEY_NOT_FOUND``."""
        with self._lock:
            return self._index.delete(_key(key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; how many."""
        with self._lock:
            return self._index.delete_prefix(_key(prefix))

    # -- inspection -----------------------------------------------------------

    def clear(self) -> None:
        """Drop every object and give their memory back (counters are kept;
        objects being read keep their bytes until released)."""
        with self._lock:
            self._index.clear()
            self._release_free_locked()

    def keys(self) -> list[str]:
        """Keys, the next to be evicted first."""
        with self._lock:
            return [key.decode("utf-8", "surrogatepass") for key in self._index.objects]

    def stats(self) -> dict[str, int]:
        """Counters since creation (``_index.STAT_NAMES``), plus ``objects``,
        ``used_bytes``, ``capacity_bytes`` and ``injected_errors`` (0: a
        store injects nothing; a ``FaultyServer`` in front counts its own)."""
        index = self._index
        with self._lock:
            out = {name: index.stats[name] for name in STAT_NAMES}
            out["objects"] = len(index.objects)
            out["used_bytes"] = index.used
            out["capacity_bytes"] = index.capacity
        out["injected_errors"] = 0
        return out

    def __len__(self) -> int:
        return len(self._index.objects)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and _key(key) in self._index.objects

    def __repr__(self) -> str:
        return (
            f"<EmbeddedServer {self.name!r} used={human_bytes(self.used_bytes)}"
            f"/{human_bytes(self.capacity_bytes)} objects={len(self)}>"
        )


# -- registry -----------------------------------------------------------------

_SERVERS: dict[str, EmbeddedServer] = {}
_SERVERS_LOCK = threading.Lock()


def get_or_create(name: str, make: Callable[[str], EmbeddedServer]) -> EmbeddedServer:
    """The server called ``name``, made with ``make(name)`` on first use."""
    server = _SERVERS.get(name)
    if server is not None:
        return server
    with _SERVERS_LOCK:
        server = _SERVERS.get(name)
        if server is None:
            server = make(name)
            _SERVERS[name] = server
            logger.info(
                "in-process local store %r created, capacity %s", name, human_bytes(server.capacity_bytes)
            )
        return server


def reset_servers(*names: str) -> None:
    """Forget the named servers, or every server when no name is given.
    Clients already holding a forgotten server keep using it; a new
    ``Store()`` of that name gets a fresh, empty one."""
    with _SERVERS_LOCK:
        if not names:
            _SERVERS.clear()
        for name in names:
            _SERVERS.pop(name, None)


def server_names() -> list[str]:
    """Names of the servers in the registry, sorted."""
    with _SERVERS_LOCK:
        return sorted(_SERVERS)
