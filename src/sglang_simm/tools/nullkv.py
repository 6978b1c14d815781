"""A null SiMM client: the ``simm.kv`` surface, answering at once.

For measuring a backend's own work per call (key building, pointer
arithmetic, view objects, result handling) apart from the store's: the batch
calls touch no memory and answer from the arguments alone::

    mexists(keys)        -> [Store.exists_answer] * len(keys)
    mget(keys, views)    -> each view's size (a full read)
    mput(keys, views)    -> [0] * len(keys) (stored)

``exists_answer`` is a per-``Store`` attribute: False makes a backend's
``batch_set_v1`` take its write path (mexists, then mput of every object),
True makes ``batch_exists`` walk every key to the end. ``release_points``
(None by default), when a list, gets the ``perf_counter()`` of every batch
call: where SiMM's client lets go of the GIL (its native batch calls run
without it), so the stretches between them are what a backend itself holds
the GIL for.

The single-key calls (``put``, ``get``, ``exists``, ``delete``) are honest,
on a small dict of copies, so the start-up warm-up round trips that both
SGLang's in-tree backend and ours make pass as they would on a cluster.

Install it where code imports ``simm.kv`` with :func:`alias_as_simm_kv`, or
hand it to ``sglang_simm.client.KVClient`` directly.
"""

from __future__ import annotations

import sys
import time
import types
from typing import Any, Sequence

import torch

__simm_null__ = True

_flags: dict[str, str] = {}


def set_flag(name: str, value: str) -> bool:
    """Accept and remember any flag (the real client refuses unknown ones;
    nothing here depends on them)."""
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError("set_flag() expects (str, str)")
    _flags[name] = value
    return True


def get_flag(name: str) -> str | None:
    return _flags.get(name)


class MrExt:
    """A registered region: only its bounds are kept."""

    __slots__ = ("owner", "size", "start")

    def __init__(self, start: int = 0, size: int = 0, owner: Any = None) -> None:
        self.start = start
        self.size = size
        self.owner = owner


def register_mr(tensor: torch.Tensor) -> MrExt | None:
    size = tensor.numel() * tensor.element_size()
    return MrExt(tensor.data_ptr(), size, tensor) if size else None


def deregister_mr(mr_ext: MrExt) -> bool:
    return isinstance(mr_ext, MrExt)


class BlockView:
    """``size`` bytes at ``ptr``; nothing is checked (the native view checks
    types only, in C++)."""

    __slots__ = ("_owner", "_ptr", "_size")

    def __init__(self, ptr: int, size: int, owner: Any = None) -> None:
        self._ptr = ptr
        self._size = size
        self._owner = owner

    @classmethod
    def from_buffer(cls, buf_ptr: int, buf_size: int, mr_ext: MrExt) -> BlockView:
        return cls(buf_ptr, buf_size)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, mr_ext: MrExt) -> BlockView:
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def as_ref(self) -> torch.Tensor:
        if self._owner is None:
            raise ValueError("as_ref() of a null view over caller memory")
        return self._owner


class Block:
    """A real client-owned buffer (warm-ups read and write it)."""

    __slots__ = ("_tensor",)

    def __init__(self, size: int) -> None:
        self._tensor = torch.zeros(size, dtype=torch.uint8)

    def as_ref(self) -> torch.Tensor:
        return self._tensor

    def view(self) -> BlockView:
        return BlockView(self._tensor.data_ptr(), self._tensor.numel(), self._tensor)


class Store:
    """Batch calls answer at once; single-key calls keep real copies."""

    def __init__(self) -> None:
        self.exists_answer = True
        self.release_points: list[float] | None = None
        self._single: dict[str, bytes] = {}

    def allocate(self, block_size: int) -> Block:
        return Block(int(block_size))

    # -- batch: no memory touched --------------------------------------------

    def mexists(self, keys: Sequence[str]) -> list[bool]:
        if self.release_points is not None:
            self.release_points.append(time.perf_counter())
        return [self.exists_answer] * len(keys)

    def mget(self, keys: Sequence[str], blocks: Sequence[BlockView]) -> list[int]:
        if self.release_points is not None:
            self.release_points.append(time.perf_counter())
        return [v._size for v in blocks]

    def mput(self, keys: Sequence[str], blocks: Sequence[BlockView]) -> list[int]:
        if self.release_points is not None:
            self.release_points.append(time.perf_counter())
        return [0] * len(keys)

    # -- single key: honest, for warm-ups ----------------------------------------

    def put(self, key: str, block: BlockView) -> int:
        self._single[key] = bytes(block.as_ref().numpy().tobytes())
        return 0

    def get(self, key: str, block: BlockView) -> int:
        data = self._single.get(key)
        if data is None:
            return -2101  # GET_OBJECT_FAILED, as the real sync client reports a miss
        dst = block.as_ref()
        n = min(len(data), dst.numel())
        dst[:n].copy_(torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8))
        return n

    def exists(self, key: str) -> bool:
        return key in self._single

    def delete(self, key: str) -> int:
        return 0 if self._single.pop(key, None) is not None else -4003

    def close(self) -> None:
        self._single.clear()

    def __repr__(self) -> str:
        return f"<Store null exists_answer={self.exists_answer}>"


_ABSENT = object()


class alias_as_simm_kv:
    """Make ``import simm.kv`` load ``module`` (this one by default) while
    the ``with`` block runs; the previous entries come back afterwards."""

    def __init__(self, module: types.ModuleType | None = None) -> None:
        self.module = module if module is not None else sys.modules[__name__]
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> types.ModuleType:
        package = types.ModuleType("simm", "Stand-in for SiMM's package")
        package.__path__ = []
        package.kv = self.module
        self._saved = {name: sys.modules.get(name, _ABSENT) for name in ("simm", "simm.kv")}
        sys.modules["simm"] = package
        sys.modules["simm.kv"] = self.module
        return self.module

    def __exit__(self, *exc_info: object) -> None:
        for name, previous in self._saved.items():
            if previous is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
