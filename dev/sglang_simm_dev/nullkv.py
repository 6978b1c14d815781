"""A null SiMM client: the ``simm.kv`` surface, answering at once.

For measuring a backend's own work per call (key building, pointer
arithmetic, view objects, result handling) apart from the store's: the batch
calls touch no memory and answer from the arguments alone::

    mexists(keys)        -> [Store.exists_answer] * len(keys)
    mget(keys, views)    -> each view's size (a full read)
    mput(keys, views)    -> [0] * len(keys) (stored)

It is built in SiMM's layers (``simm/kv/__init__.py`` at HEAD): a native
module ``_kv`` (``DataView``, ``KVStore`` with ``MPut``/``MGet``/``MExists``)
under Python classes (``BlockView`` wrapping one ``DataView``, ``Store``
wrapping a ``KVStore`` as ``_impl`` and unwrapping views in a Python loop),
so a backend pays here what it would pay SiMM's Python layer, and one that
calls the native layer directly (ours, ``client.KVClient``) saves here what
it saves there. The native parts are Python classes: a ``DataView`` costs
one ``__init__``, about a native constructor's cost.

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

import ctypes
import importlib.machinery
import importlib.util
import os
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


def deregister_mr(mr_ext: Any) -> bool:
    return isinstance(mr_ext, MrExt)


class DataView:
    """The native view (``simm.kv._kv.DataView``, a nanobind class in SiMM):
    ``size`` bytes at ``ptr``. One Python ``__init__`` per view here, about
    twice what a nanobind constructor costs (``NATIVE_ENV`` swaps in a
    real one); nothing is checked."""

    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int, mr_ext: Any = None) -> None:
        self.ptr = ptr
        self.size = size


class KVStore:
    """The native store (``simm.kv._kv.KVStore``): batch calls on native
    views answer at once; single-key calls keep real copies of the bytes
    at the view."""

    def __init__(self) -> None:
        self.exists_answer = True
        self.release_points: list[float] | None = None
        self._single: dict[str, bytes] = {}

    def _released(self) -> None:
        """A batch call: where SiMM's client lets go of the GIL."""
        if self.release_points is not None:
            self.release_points.append(time.perf_counter())

    # -- batch: no memory touched --------------------------------------------

    def MExists(self, keys: Sequence[str]) -> list[int]:  # noqa: N802 (SiMM's native names)
        self._released()
        return [0 if self.exists_answer else -2101] * len(keys)

    def MGet(self, keys: Sequence[str], datas: Sequence[Any]) -> list[int]:  # noqa: N802
        self._released()
        return [d.size for d in datas]

    def MPut(self, keys: Sequence[str], datas: Sequence[Any]) -> list[int]:  # noqa: N802
        self._released()
        return [0] * len(keys)

    # -- single key: honest, for warm-ups ----------------------------------------

    def Put(self, key: str, data: Any) -> int:  # noqa: N802
        self._single[key] = ctypes.string_at(data.ptr, data.size)
        return 0

    def Get(self, key: str, data: Any) -> int:  # noqa: N802
        stored = self._single.get(key)
        if stored is None:
            return -2101  # GET_OBJECT_FAILED, as the real sync client reports a miss
        n = min(len(stored), data.size)
        ctypes.memmove(data.ptr, stored, n)
        return n

    def Exists(self, key: str) -> int:  # noqa: N802
        return 0 if key in self._single else -2101

    def Delete(self, key: str) -> int:  # noqa: N802
        return 0 if self._single.pop(key, None) is not None else -4003


#: Names a folder holding ``_nullkv_native`` (built by
#: ``benchmarks/native_views/build.sh``): a nanobind module with SiMM's
#: binding signatures (``DataView``, ``MrExt``, ``KVStore.MPut``/``MGet``/
#: ``MExists`` on ``std::vector``s, GIL released). With it the null's
#: native layer costs what nanobind costs: a view each, and the conversion
#: of every key and view a batch call pays on its way into C++.
NATIVE_ENV = "SGLANG_SIMM_NULL_NATIVE"


def _load_native() -> types.ModuleType | None:
    folder = os.environ.get(NATIVE_ENV)
    if not folder:
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_nullkv_native" + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("_nullkv_native", path)
            if spec is None or spec.loader is None:
                break
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise ImportError(
        f"{NATIVE_ENV}={folder!r} holds no _nullkv_native{importlib.machinery.EXTENSION_SUFFIXES[0]}: "
        "build it with benchmarks/native_views/build.sh, or unset the variable"
    )


_native = _load_native()
#: which native layer this null client has: "python" or "nanobind"
NATIVE = "nanobind" if _native is not None else "python"

if _native is not None:
    DataView = _native.DataView  # type: ignore[misc,assignment]  # noqa: F811
    MrExt = _native.MrExt  # type: ignore[misc,assignment]  # noqa: F811

    def register_mr(tensor: torch.Tensor) -> Any:  # type: ignore[misc]  # noqa: F811
        size = tensor.numel() * tensor.element_size()
        return _native.register_mr(tensor.data_ptr(), size) if size else None

    class _NanobindKVStore(KVStore):
        """Batch calls through the nanobind store, which converts every key
        and view into C++ as SiMM's does (one Python frame in front, the
        same for every backend); single-key calls as above."""

        def __init__(self) -> None:
            super().__init__()
            self._native = _native.KVStore()

        def MExists(self, keys: Sequence[str]) -> list[int]:  # noqa: N802
            self._released()
            codes = self._native.MExists(keys)
            return codes if self.exists_answer else [-2101] * len(codes)

        def MGet(self, keys: Sequence[str], datas: Sequence[Any]) -> list[int]:  # noqa: N802
            self._released()
            return self._native.MGet(keys, datas)

        def MPut(self, keys: Sequence[str], datas: Sequence[Any]) -> list[int]:  # noqa: N802
            self._released()
            return self._native.MPut(keys, datas)

    KVStore = _NanobindKVStore  # type: ignore[misc]  # noqa: F811


#: SiMM's native extension module (``simm.kv._kv``), as the Python layer
#: below reaches it.
_kv = types.SimpleNamespace(DataView=DataView, KVStore=KVStore, MrExt=MrExt)


class BlockView:
    """SiMM's Python view: a wrapper around one native ``DataView``, made by
    a classmethod, as in ``simm/kv/__init__.py``."""

    __slots__ = ("_data",)

    def __init__(self, data: DataView) -> None:
        self._data = data

    @classmethod
    def from_buffer(cls, buf_ptr: int, buf_size: int, mr_ext: MrExt) -> BlockView:
        return BlockView(_kv.DataView(buf_ptr, buf_size, mr_ext))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, mr_ext: MrExt) -> BlockView:
        return BlockView(_kv.DataView(tensor.data_ptr(), tensor.numel() * tensor.element_size(), mr_ext))

    def as_ref(self) -> torch.Tensor:
        data = self._data
        if not data.size:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer((ctypes.c_uint8 * data.size).from_address(data.ptr), dtype=torch.uint8)


class Block:
    """A real client-owned buffer (warm-ups read and write it)."""

    __slots__ = ("_tensor",)

    def __init__(self, size: int) -> None:
        self._tensor = torch.zeros(size, dtype=torch.uint8)

    def as_ref(self) -> torch.Tensor:
        return self._tensor

    def view(self) -> BlockView:
        return BlockView(_kv.DataView(self._tensor.data_ptr(), self._tensor.numel(), register_mr(self._tensor)))


class Store:
    """SiMM's Python ``Store`` over the native one (``_impl``), layer for
    layer: the batch calls unwrap every view in a Python loop, and
    ``mexists`` turns codes into bools, as SiMM's own do."""

    def __init__(self) -> None:
        self._impl = _kv.KVStore()

    # the null client's knobs live on the native store, where the calls are
    @property
    def exists_answer(self) -> bool:
        return self._impl.exists_answer

    @exists_answer.setter
    def exists_answer(self, value: bool) -> None:
        self._impl.exists_answer = value

    @property
    def release_points(self) -> list[float] | None:
        return self._impl.release_points

    @release_points.setter
    def release_points(self, value: list[float] | None) -> None:
        self._impl.release_points = value

    def allocate(self, block_size: int) -> Block:
        return Block(int(block_size))

    def mexists(self, keys: Sequence[str]) -> list[bool]:
        rets = self._impl.MExists(keys)
        return [ret == 0 for ret in rets]

    def mget(self, keys: Sequence[str], blocks: Sequence[BlockView]) -> list[int]:
        datas: list[DataView] = []
        for block in blocks:
            datas.append(block._data)
        return self._impl.MGet(keys, datas)

    def mput(self, keys: Sequence[str], blocks: Sequence[BlockView]) -> list[int]:
        datas: list[DataView] = []
        for block in blocks:
            datas.append(block._data)
        return self._impl.MPut(keys, datas)

    def put(self, key: str, block: BlockView) -> int:
        return self._impl.Put(key, block._data)

    def get(self, key: str, block: BlockView) -> int:
        return self._impl.Get(key, block._data)

    def exists(self, key: str) -> bool:
        return self._impl.Exists(key) == 0

    def delete(self, key: str) -> int:
        return self._impl.Delete(key)

    def close(self) -> None:
        self._impl._single.clear()

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
