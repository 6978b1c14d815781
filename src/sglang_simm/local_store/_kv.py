"""The ``simm.kv`` surface of the local store.

Same names, signatures, return types and codes as SiMM's Python client, as
of SiMM's HEAD by default (``local_store_simm_release=v0.1.0.post1``: the
only tag, where it differs); where the real client's code differs from its
documentation, the code wins. Each rule, with the line of SiMM's source it
follows, is in docs/local-store.md ("Semantics"). Local-store-only extras
(probe with ``hasattr``): ``get_flag``, ``Store.server``, ``Store.close``,
``Store.delete_prefix``, ``Store.mput_absent``, ``Store.mexists_codes``,
``Store.removed_since``.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import operator
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence

import torch

from sglang_simm.local_store import _flags, _handle
from sglang_simm.local_store._copy import human_bytes, wrap_memory
from sglang_simm.local_store._flags import HEAD
from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable
from sglang_simm.local_store._paths import StorePaths, lock_held, store_dir
from sglang_simm.local_store._segments import default_capacity_bytes
from sglang_simm.simm_rules import (
    BUILD_CONNECTION_FAILED,
    DS_DATA_ALREADY_EXISTS,
    GET_OBJECT_FAILED,
    INVALID_ARGUMENT,
    MAX_VALUE_BYTES,
    OK,
    PUT_OBJECT_FAILED,
    REGISTER_MR_FAILED,
    TRANSPORT_CODES,
    key_fits,
    keys_fit,
)

logger = logging.getLogger("sglang_simm.local_store")

DEFAULT_SERVER_NAME = "default"

get_flag = _flags.get_flag


def set_flag(name: str, value: str) -> bool:
    """Set a process-global client flag; True if it was accepted (an unknown
    name or a value that does not parse: False, nothing changed). The
    ``local_store_*`` flags apply to a store when this process starts or
    opens it; ``simm_release`` and ``get_bound`` on every call."""
    return _flags.set_value(name, value) is not None


# -- stores ---------------------------------------------------------------------------------

_clients: dict[StoreHandle, int] = {}  # open ``Store()`` clients per handle
_clients_lock = threading.Lock()
_private_root: str | None = None  # the ``process`` scope's directory, this process's own


def _root(settings: _flags.LocalStoreSettings) -> str:
    """Where this process's stores live: the ``host`` scope's directory, or for
    ``process`` a private one made on first use (a store on a thread of this
    process, gone with it)."""
    global _private_root
    if settings.scope == "host":
        return store_dir(settings.dir)
    if _private_root is None or not os.path.isdir(_private_root):
        parent = store_dir(settings.dir)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        _private_root = tempfile.mkdtemp(prefix=f"inprocess-{os.getpid()}-", dir=parent)
        atexit.register(shutil.rmtree, _private_root, True)
    return _private_root


def _handle_for(name: str) -> StoreHandle:
    settings = _flags.local_settings()
    root, host = _root(settings), settings.scope == "host"
    capacity = settings.capacity_bytes or default_capacity_bytes(root)
    if not host and not lock_held(StorePaths(root, name)):
        from sglang_simm.local_store._server import StoreRefused, serve_in_thread

        try:
            serve_in_thread(root, name, capacity, settings.eviction)
        except StoreRefused as exc:
            raise StoreUnreachable(BUILD_CONNECTION_FAILED, str(exc)) from exc
    return _handle.get_or_open(name, root=root, capacity=capacity, policy=settings.eviction,
                               timeout_s=settings.request_timeout_s, idle_exit_s=settings.idle_exit_s, spawn=host)


def get_server(name: str) -> StoreHandle:
    """This process's handle on the local store ``name`` (started on first use
    with the current ``local_store_*`` flags); ``StoreUnreachable`` (a
    ``ConnectionError``) when it cannot be reached."""
    if not isinstance(name, str):
        raise TypeError(f"server name must be a str, got {name!r}")
    return _handle_for(name or DEFAULT_SERVER_NAME)


def reset_servers(*names: str) -> None:
    """Stop the named stores of this process's handles (every one when no
    name is given), discarding their objects: a new ``Store()`` of such a
    name gets a fresh, empty store."""
    _handle.forget(*names)


def server_names() -> list[str]:
    """Names of the stores this process has a handle on, sorted."""
    return _handle.handle_names()


# -- memory regions ---------------------------------------------------------------


class _Region:
    """A registered host region. Holds its tensor, so the memory stays valid
    while the region is registered (as RDMA registration pins it)."""

    __slots__ = ("end", "owner", "start")

    def __init__(self, start: int, size: int, owner: object) -> None:
        self.start = start
        self.end = start + size
        self.owner = owner


_regions: dict[int, _Region] = {}  # descriptor -> region; reads rely on dict atomicity
_region_ids = itertools.count(1)


class MrExt:
    """Handle of a registered memory region (returned by ``register_mr``)."""

    __slots__ = ("_desc",)

    def __init__(self) -> None:
        self._desc: int | None = None  # like the native default: no descriptor

    @classmethod
    def _of(cls, desc: int) -> MrExt:
        mr = cls()
        mr._desc = desc
        return mr

    def __repr__(self) -> str:
        region = _regions.get(self._desc) if self._desc is not None else None
        if region is None:
            return "<MrExt unregistered>"
        return f"<MrExt 0x{region.start:x}+{human_bytes(region.end - region.start)}>"


def register_mr(tensor: torch.Tensor) -> MrExt | None:
    """Register a host tensor's memory (``data_ptr``, ``numel * element_size``).

    Raises TypeError for anything but a CPU tensor; returns None when the
    region cannot be registered (an empty tensor), as the native call does.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"register_mr() expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(f"register_mr() needs a host (CPU) tensor, got one on {tensor.device}")
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        logger.warning("register_mr(): cannot register an empty tensor")
        return None
    desc = next(_region_ids)
    _regions[desc] = _Region(tensor.data_ptr(), size, tensor)
    return MrExt._of(desc)


def deregister_mr(mr_ext: MrExt) -> bool:
    """Undo ``register_mr``; False if ``mr_ext`` is not registered (any more)."""
    if not isinstance(mr_ext, MrExt):
        raise TypeError(f"deregister_mr() expects an MrExt, got {type(mr_ext).__name__}")
    desc = mr_ext._desc
    if desc is None or _regions.pop(desc, None) is None:
        return False
    mr_ext._desc = None
    return True


class BlockView:
    """``size`` bytes at ``ptr`` inside a registered region. Cheap: nothing is
    checked here but types; a call using the view checks its region."""

    __slots__ = ("_desc", "_owner", "_ptr", "_size")

    def __init__(self, ptr: int, size: int, desc: int | None, owner: object = None) -> None:
        self._ptr = ptr
        self._size = size
        self._desc = desc  # copied from the MrExt when made, like the native view
        self._owner = owner

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, mr_ext: MrExt) -> BlockView:
        return cls.from_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size(), mr_ext)

    @classmethod
    def from_buffer(cls, buf_ptr: int, buf_size: int, mr_ext: MrExt) -> BlockView:
        ptr = operator.index(buf_ptr)
        size = operator.index(buf_size)
        if ptr < 0 or size < 0 or not isinstance(mr_ext, MrExt):
            raise TypeError(
                "BlockView.from_buffer(): expected (ptr: int >= 0, size: int >= 0, mr_ext: MrExt), "
                f"got ({buf_ptr!r}, {buf_size!r}, {type(mr_ext).__name__})"
            )
        return cls(ptr, size, mr_ext._desc)

    def as_ref(self) -> torch.Tensor:
        """A uint8 tensor over the view's memory (no copy)."""
        tensor = wrap_memory(self._ptr, self._size)
        if self._owner is not None:
            tensor._simm_owner = self._owner  # keep a Block alive while its memory is referenced
        return tensor

    def __repr__(self) -> str:
        return f"<BlockView 0x{self._ptr:x}+{self._size}>"


class Block:
    """A client-owned buffer from ``Store.allocate``, registered implicitly."""

    __slots__ = ("__weakref__", "_desc", "_tensor")

    def __init__(self, size: int) -> None:
        self._tensor = torch.empty(size, dtype=torch.uint8)
        self._desc = next(_region_ids)
        # Held by the table only while the Block lives.
        _regions[self._desc] = _Region(self._tensor.data_ptr(), size, None)

    def __del__(self) -> None:
        desc = getattr(self, "_desc", None)  # absent if allocation failed
        if desc is not None:
            _regions.pop(desc, None)

    def as_ref(self) -> torch.Tensor:
        return self._tensor

    def view(self) -> BlockView:
        return BlockView(self._tensor.data_ptr(), self._tensor.numel(), self._desc, self)

    def __repr__(self) -> str:
        return f"<Block {human_bytes(self._tensor.numel())}>"


# -- checks before the network -----------------------------------------------------


def _as_key(key: object) -> str:
    """nanobind's ``std::string`` caster: a ``str`` that encodes as UTF-8, else TypeError."""
    if not isinstance(key, str):
        raise TypeError(f"incompatible function arguments: key must be a str, got {type(key).__name__}")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError("incompatible function arguments: key is not valid UTF-8 (a lone surrogate)") from None
    return key


def _as_keys(keys: object) -> list[str]:
    """nanobind's ``std::vector<std::string>`` caster: a sequence (not a
    ``str`` or ``bytes``) of such strings, else TypeError."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"incompatible function arguments: keys must be a list of str, got {type(keys).__name__}")
    keys = list(keys)
    try:
        if "".join(keys).isascii():  # the common batch, checked at C speed
            return keys
    except TypeError:
        pass  # a key that is not a str: named below
    return [_as_key(k) for k in keys]


def _as_view(view: object) -> BlockView:
    """The Python wrapper reads ``block._data``: anything else is an AttributeError."""
    if not isinstance(view, BlockView):
        raise AttributeError(f"{type(view).__name__!r} object has no attribute '_data'")
    return view


def _as_views(views: object) -> list[BlockView]:
    """Any iterable of BlockViews (the wrapper loops over it in Python)."""
    return [_as_view(v) for v in views]


def _region_code(view: BlockView, pins: list) -> int:
    """OK (the region appended to ``pins`` to keep it alive for the call) or
    the view's failure code."""
    desc = view._desc
    if desc is None:
        return INVALID_ARGUMENT
    region = _regions.get(desc)
    if region is None or view._ptr < region.start or view._ptr + view._size > region.end:
        return REGISTER_MR_FAILED
    pins.append(region)
    return OK


def _view_bound(view: BlockView) -> int:
    return view._size


def _region_bound(view: BlockView) -> int:
    """SiMM's own get bound: the client sends the registered region's size,
    not the view's (``clnt_messenger.cc`` Get: ``set_buf_len(mem_desc->getSize())``),
    so an object longer than its view is written past it, over whatever the
    region holds next, and get returns the object's length. Past the
    region's end the real write fails in the NIC; here it is refused."""
    region = _regions.get(view._desc)
    return region.end - view._ptr if region is not None else view._size


def _release() -> str:
    return _flags.local_settings().simm_release


# -- the store ------------------------------------------------------------------------


class Store:
    """A client of the local store named by the ``cm_primary_node_ip`` flag
    when it is made (started on first use). Stores of one name share their
    objects, like clients of one cluster, and this process's handle on it."""

    __slots__ = ("_handle", "_open")

    def __init__(self) -> None:
        try:
            handle = _handle_for(_flags.server_name() or DEFAULT_SERVER_NAME)  # cm_primary_node_ip
        except (StoreUnreachable, OSError) as exc:
            raise RuntimeError(f"Init client messenger failed: {exc}") from exc
        with _clients_lock:
            _clients[handle] = _clients.get(handle, 0) + 1
        self._handle = handle
        self._open = True

    def close(self) -> None:
        """This client is done (SiMM's ``Store`` has none: its connections go
        with the last reference). The last client of a store in this process
        drops the connection; calls after it connect again. Idempotent."""
        if not self._open:
            return
        self._open = False
        with _clients_lock:
            left = _clients[self._handle] = _clients[self._handle] - 1
        if not left:
            self._handle.disconnect()

    @property
    def server(self) -> StoreHandle:
        """The local store behind this client (local store only)."""
        return self._handle

    def allocate(self, block_size: int) -> Block:
        size = operator.index(block_size)
        if size < 0:
            raise TypeError(f"allocate(): block_size must be >= 0, got {block_size!r}")
        if size > MAX_VALUE_BYTES:
            logger.warning("allocating a block of %d B, above the max value size %d B", size, MAX_VALUE_BYTES)
        return Block(size)

    # -- sync ------------------------------------------------------------

    def put(self, key: str, block: BlockView) -> int:
        return self._put([_as_key(key)], [_as_view(block)], overwrite=True, passthrough=False)[0]

    def get(self, key: str, block: BlockView) -> int:
        return self._get([_as_key(key)], [_as_view(block)], passthrough=False)[0]

    def exists(self, key: str) -> bool:
        return self._lookup([_as_key(key)])[0] == OK

    def delete(self, key: str) -> int:
        key = _as_key(key)
        code = self._delete(key)
        # At the v0.1.0.post1 tag the sync delete answered 0 past the key
        # check, on every path (clnt_messenger.cc Delete); HEAD passes the
        # server's code (775cea9).
        return code if _release() == HEAD or not key_fits(key, empty_ok=True) else OK

    def _delete(self, key: str) -> int:
        if not key_fits(key, empty_ok=True):
            return INVALID_ARGUMENT
        try:
            return self._handle.delete(key)
        except StoreUnreachable as exc:  # transport codes pass through
            return exc.code

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix`` (non-empty);
        returns how many. Local store only: SiMM's client cannot list keys.
        Nothing is deleted (0) while the store cannot be reached (down)."""
        prefix = _as_key(prefix)
        if not prefix:
            raise ValueError("delete_prefix() needs a non-empty prefix")
        try:
            return self._handle.delete_prefix(prefix)
        except StoreUnreachable:
            return 0

    def removed_since(self, cursor: object = None) -> tuple[object, bool, list[str], list[str]]:
        """What left the store since ``cursor`` (this call's last answer;
        None: from now): ``(cursor, lost, keys removed, prefixes cleared)``;
        ``lost``: the store kept too few removals to say all (read it as
        everything cleared). Nothing, and the same cursor, while the store
        cannot be reached. Local store only."""
        try:
            return self._handle.removed_since(cursor)  # type: ignore[arg-type]
        except StoreUnreachable:
            return cursor, False, [], []

    def mput(self, keys: list[str], blocks: list[BlockView]) -> list[int]:
        # SiMM HEAD (dfe269a) deletes and re-puts an existing key in mput; the
        # v0.1.0.post1 tag kept the old object and answered -4005.
        return self._put(_as_keys(keys), _as_views(blocks), overwrite=_release() == HEAD, passthrough=False)

    def mput_absent(self, keys: list[str], blocks: list[BlockView]) -> list[int]:
        """Put the objects whose keys are not stored yet: per key 0 (stored
        now), ``DS_DATA_ALREADY_EXISTS`` (-4005: stored before, left alone)
        or mput's failure codes. Local store only: on the local store's process it folds
        ``mexists`` + ``mput`` into one put (reserve, copy, publish)."""
        return self._put(_as_keys(keys), _as_views(blocks), overwrite=False, passthrough=False)

    def mget(self, keys: list[str], blocks: list[BlockView]) -> list[int]:
        return self._get(_as_keys(keys), _as_views(blocks), passthrough=False)

    def mexists(self, keys: list[str]) -> list[bool]:
        return [code == OK for code in self._lookup(_as_keys(keys))]

    def mexists_codes(self, keys: list[str]) -> list[int]:
        """``mexists`` before its codes become bools: per key OK (0) where
        the object exists, else why not (SiMM's native ``MExists``)."""
        return self._lookup(_as_keys(keys))

    # -- async (the sync op in the loop's default executor) ---------------

    async def exists_async(self, key: str) -> bool:
        return await _in_executor(self.exists, key)

    async def get_async(self, key: str, block: BlockView) -> int:
        return await _in_executor(self._get_passthrough, key, block)

    async def put_async(self, key: str, block: BlockView) -> int:
        return await _in_executor(self._put_passthrough, key, block)

    async def delete_async(self, key: str) -> int:
        return await _in_executor(self._delete, _as_key(key))

    def _get_passthrough(self, key: str, block: BlockView) -> int:
        return self._get([_as_key(key)], [_as_view(block)], passthrough=True)[0]

    def _put_passthrough(self, key: str, block: BlockView) -> int:
        return self._put([_as_key(key)], [_as_view(block)], overwrite=False, passthrough=True)[0]

    # -- the pipeline: checks, then the store ---------------------------------
    #
    # The store's own refusals are mapped per path, as the real client maps
    # its data server's; a transport failure passes through on every path:
    # a whole batch (``StoreUnreachable``) or an entry (``TRANSPORT_CODES``).

    @staticmethod
    def _admit(views: list[BlockView], results: list[int]) -> tuple[list[int], list[_Region]]:
        """Indices of the entries whose view lies in registered memory, and
        the regions to hold until the copy is done. Refused entries get
        their code in ``results``."""
        pins: list[_Region] = []
        live = []
        for i, view in enumerate(views):
            code = _region_code(view, pins)
            if code:
                results[i] = code
            else:
                live.append(i)
        return live, pins

    def _put(
        self, keys: list[str], views: list[BlockView], *, overwrite: bool, passthrough: bool
    ) -> list[int]:
        n = len(keys)
        if n != len(views):
            return [INVALID_ARGUMENT] * n
        # SiMM checks every key and the value sizes of a put, batch-wide
        # (clnt_kv.cc:294-302); a zero-byte value is not refused.
        if not keys_fit(keys, empty_ok=True) or not all(view._size <= MAX_VALUE_BYTES for view in views):
            return [INVALID_ARGUMENT] * n
        results = [OK] * n
        live, pins = self._admit(views, results)  # noqa: F841 (pins: held for the copy)
        if not live:
            return results
        try:
            codes = self._handle.put_from([(keys[i], views[i]._ptr, views[i]._size) for i in live], overwrite)
        except StoreUnreachable as exc:
            for i in live:
                results[i] = exc.code
            return results
        for i, code in zip(live, codes):
            # the sync client reports any store refusal but "already exists"
            # as PutObjectFailed (clnt_messenger.cc, ClientMessenger::Put)
            if code < 0 and not passthrough and code != DS_DATA_ALREADY_EXISTS and code not in TRANSPORT_CODES:
                code = PUT_OBJECT_FAILED
            results[i] = code
        return results

    def _get(self, keys: list[str], views: list[BlockView], *, passthrough: bool) -> list[int]:
        n = len(keys)
        if n != len(views):
            return [INVALID_ARGUMENT] * n
        if not keys_fit(keys, empty_ok=True):
            return [INVALID_ARGUMENT] * n
        results = [OK] * n
        live, pins = self._admit(views, results)  # noqa: F841 (pins: held for the copy)
        if not live:
            return results
        bound = _region_bound if _flags.local_settings().get_bound == "region" else _view_bound
        try:
            codes = self._handle.get_into([(keys[i], views[i]._ptr, bound(views[i])) for i in live])
        except StoreUnreachable as exc:
            for i in live:
                results[i] = exc.code
            return results
        for i, code in zip(live, codes):
            # the sync client reports every store-side get failure as
            # GetObjectFailed (clnt_messenger.cc, ClientMessenger::Get)
            if code < 0 and not passthrough and code not in TRANSPORT_CODES:
                code = GET_OBJECT_FAILED
            results[i] = code
        return results

    def _lookup(self, keys: list[str]) -> list[int]:
        n = len(keys)
        if not keys_fit(keys, empty_ok=True):
            return [INVALID_ARGUMENT] * n
        if not n:
            return []
        try:
            return list(self._handle.lookup(keys))
        except StoreUnreachable as exc:
            return [exc.code] * n

    def __repr__(self) -> str:
        return f"<Store local_store={self._handle.name!r}>"


async def _in_executor(fn, *args):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, fn, *args)
