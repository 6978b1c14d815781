"""The store contract: what ``kv.Store`` asks of the store behind it, and
the one error it raises.

``StoreHandle`` implements it for the local store (and a test instrument's
fault wrapper, in front of one, implements it too); ``tests/contract/``
holds every store, SiMM's real client included, to the same behaviour.
Importing this module imports nothing of the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from sglang_simm.simm_rules import code_name


class StoreUnreachable(ConnectionError):
    """The store could not serve a call; ``code`` is what its entries fail
    with (a transport code). ``no_store``: nothing listens (starting one may
    help); ``refused``: the store answered and said no."""

    def __init__(self, code: int, why: str, *, no_store: bool = False, refused: bool = False) -> None:
        super().__init__(f"{code_name(code)}: {why}")
        self.code, self.no_store, self.refused = code, no_store, refused


@runtime_checkable
class StoreServer(Protocol):
    """One store, shared by name by every ``Store()`` that joins it.

    Codes are SiMM's data server's (``sglang_simm.simm_rules``); the layer
    above maps them per path. Every batch call answers one entry per item,
    in order; entries succeed or fail on their own.

    * ``put_from(items, overwrite)``: store ``(key, ptr, size)`` entries,
      copying ``size`` bytes from ``ptr``. Per entry: OK;
      ``DS_DATA_ALREADY_EXISTS`` when the key is stored and ``overwrite`` is
      false; ``DS_CACHE_POOL_ALLOC_FAILED`` when the object cannot fit (or
      past the client's share of the capacity); ``OUT_OF_MEMORY`` when the
      host cannot back it; ``INVALID_ARGUMENT`` for a key or size past
      SiMM's limits. A key named twice: with ``overwrite`` the later entry
      wins, without it the earlier.
    * ``get_into(items)``: copy objects into ``(key, ptr, capacity)``
      buffers. Per entry: the object's size; ``DS_KEY_NOT_FOUND`` (also for
      an object whose checksum failed); ``INVALID_ARGUMENT`` when the buffer
      is smaller (nothing written); ``TARGET_UNAVAILABLE`` past the client's
      share. With LRU eviction a hit makes the object young.
    * ``lookup(keys)``: per key OK or ``DS_KEY_NOT_FOUND``; eviction order
      left alone. ``delete(key)``: OK or ``DS_KEY_NOT_FOUND``;
      ``delete_prefix(prefix)``: how many objects it deleted.
    * ``clear()``: drop every object (counters kept). ``keys()``: every key,
      the next to be evicted first. ``stats()``: the counters and settings.
    * ``capacity_bytes``, ``used_bytes``; ``set_capacity(n)`` (evicting until
      the objects fit; TypeError or ValueError for a bad ``n``, or one above
      what the store's segment holds) and ``set_policy(policy)`` ("fifo":
      oldest put first, as SiMM's data server; "lru"; ValueError else).
    * ``name``: the store's name.

    Consistency: an object is visible only once whole, a reader copies a
    whole value, old or new, never a torn or foreign one, and a put that
    fails leaves the key's value alone. ``ptr`` must stay valid for the
    call only. Faults: a batch that could not reach the store within its
    time limit raises ``StoreUnreachable`` (a ``ConnectionError`` whose
    ``code`` is a transport code), which the layer above answers for every
    entry; operator calls may raise it too.
    """

    name: str

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]: ...

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]: ...

    def lookup(self, keys: Sequence[str]) -> list[int]: ...

    def delete(self, key: str) -> int: ...

    def delete_prefix(self, prefix: str) -> int: ...

    def clear(self) -> None: ...

    def keys(self) -> list[str]: ...

    def stats(self) -> dict[str, Any]: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def set_capacity(self, capacity_bytes: int) -> None: ...

    def set_policy(self, policy: str) -> None: ...
