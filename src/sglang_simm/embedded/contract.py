"""The server contract: what the ``simm.kv`` layer (``_client``) asks of the
store behind a ``Store()``, whichever form it takes.

Two classes implement it: ``EmbeddedServer`` (``_server``, the store inside
this process) and ``HostServer`` (``_host``, this process's handle on the
store process of the host); ``_faults.FaultyServer``, the simulated network
installed in front of either only while faults are set, implements it too.
Both stores keep their objects by one index (``_index.StoreIndex``), so
capacity, eviction, publication and counters follow one set of rules; the
index's docstring holds them. ``_client`` holds any of them as a
``StoreServer`` and turns these answers into SiMM client results, path by
path, as the real client does; ``tests/store/test_server_contract.py``
checks that every class has every member below with the same signature.

Typing only: importing this module imports nothing else of the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class StoreServer(Protocol):
    """One store, shared by name by every ``Store()`` that joins it.

    Codes are SiMM's data server's (``simm_rules``): the layer above maps
    them per path. Every batch call answers one entry per item, in the
    items' order; entries of one batch succeed or fail on their own.

    * ``put_from(items, overwrite)``: store ``(key, ptr, size)`` entries,
      copying ``size`` bytes from ``ptr``. Per entry: OK;
      ``DS_DATA_ALREADY_EXISTS`` when the key is stored and ``overwrite`` is
      false (also when another put of the key published first);
      ``DS_CACHE_POOL_ALLOC_FAILED`` when the object cannot fit in the
      capacity (also, past the store's lease limits, a batch that cannot be
      given room now); ``OUT_OF_MEMORY`` when the host cannot back it;
      ``INVALID_ARGUMENT`` for a key or size past SiMM's limits; the host
      store also refuses an entry past its own limits (``INVALID_ARGUMENT``,
      ``TARGET_UNAVAILABLE``). A key named twice in a batch: with
      ``overwrite`` the later entry wins, without it the earlier.
    * ``get_into(items)``: copy objects into ``(key, ptr, capacity)``
      buffers. Per entry: the object's size; ``DS_KEY_NOT_FOUND``;
      ``INVALID_ARGUMENT`` when the buffer is smaller than the object
      (nothing is written); ``TARGET_UNAVAILABLE`` past the store's lease
      limits (the in-process store's: ``_server.MAX_CALLS_IN_FLIGHT`` calls
      at once). With LRU eviction a hit makes the object young.
    * ``lookup(keys)``: per key OK or ``DS_KEY_NOT_FOUND``; eviction order is
      left alone.
    * ``delete(key)``: OK or ``DS_KEY_NOT_FOUND``. ``delete_prefix(prefix)``:
      how many objects whose key starts with ``prefix`` were deleted.
    * ``clear()``: drop every object (counters are kept). ``keys()``: every
      key, the next to be evicted first.
    * ``stats()``: the counters of ``_index.STAT_NAMES`` since the store
      began, plus ``objects``, ``used_bytes``, ``capacity_bytes`` and
      ``injected_errors`` (entries this process's simulated network failed:
      0 from a store itself, a ``FaultyServer``'s count from one); the
      host store adds its own (clients, leases, refusals, ...).
    * ``capacity_bytes`` (object bytes the store holds at most) and
      ``used_bytes`` (bytes of published objects); ``set_capacity(n)``
      (evicting until the stored bytes fit; TypeError or ValueError for a
      bad ``n``, or one above what the store's arena holds: the capacity
      it was made with, plus slack) and ``set_policy(policy)`` ("fifo":
      oldest put first, as SiMM's data server; "lru": least recently used;
      ValueError else).
    * ``add_warmup_prefix(prefix)``: count keys that start with ``prefix``
      apart from now on, as well (``warmup_puts``, ``warmup_hits``), so
      that pages counted from the counters leave a client's start-up round
      trips out. The store knows no prefix of its own.
    * ``name``: the store's name.

    Consistency: an object is visible only once whole (a put copies first,
    then publishes), and a reader copies a whole old value or a whole new
    one, never a torn or foreign one; a put that fails does not replace
    the key's value. A call's memory (``ptr``) must stay valid for the call
    only: the store keeps no reference to it after returning.

    Faults: the in-process store never raises on the data path. The host
    store raises ``StoreUnreachable`` (a ``ConnectionError`` whose ``code``
    is a SiMM transport code) for a batch that could not reach the store
    process within its time limit, and a ``FaultyServer`` for a batch sent
    while the store is down; the layer above answers every entry of that
    batch with the code. An entry a ``FaultyServer`` failed on its own is
    an ``_faults.InjectedCode``, which the layer above passes through
    unmapped, as any transport failure. Operator calls (``stats``,
    ``keys``, ``set_capacity``, ...) may raise ``StoreUnreachable`` too.

    ``isinstance(obj, StoreServer)`` checks the members' presence only (and
    on Python < 3.12 reads the properties: on a host store handle that is a
    request); the signatures are checked by the tests.
    """

    name: str

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]: ...

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]: ...

    def lookup(self, keys: Sequence[str]) -> list[int]: ...

    def delete(self, key: str) -> int: ...

    def delete_prefix(self, prefix: str) -> int: ...

    def clear(self) -> None: ...

    def keys(self) -> list[str]: ...

    def stats(self) -> dict[str, int]: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def set_capacity(self, capacity_bytes: int) -> None: ...

    def set_policy(self, policy: str) -> None: ...

    def add_warmup_prefix(self, prefix: str) -> None: ...
