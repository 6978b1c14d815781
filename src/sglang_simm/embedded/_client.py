"""The ``simm.kv`` surface of the local store.

Same names, signatures, return types and codes as SiMM's Python client
(``python/simm/kv/__init__.py`` over the native ``_kv`` extension,
``src/client/clnt_kv.cc`` and ``clnt_messenger.cc``), as of SiMM's HEAD
(3b0d7ae, 2026-04-20) by default; ``local_store_simm_release=v0.1.0.post1``
follows the only tag where it differs. Where the real client's code differs
from its documentation, the code wins. Line numbers below are HEAD's:

* Sync ``get``/``mget`` report every server-side failure (absent key, buffer
  smaller than the object) as ``GET_OBJECT_FAILED`` (-2101,
  ``clnt_messenger.cc:822-825``); ``get_async`` passes the server's code
  through (``DS_KEY_NOT_FOUND`` -4003, ``INVALID_ARGUMENT`` -1000; 877-882).
* Sync ``put`` overwrites (the real client deletes and re-puts on -4005,
  ``clnt_kv.cc:91-111``; here the swap is atomic). Sync ``mput`` does too at
  HEAD (dfe269a, ``clnt_kv.cc:310-334``); at the tag it answers
  ``DS_DATA_ALREADY_EXISTS`` (-4005) and keeps the old object. ``put_async``
  never overwrites (-4005, ``clnt_messenger.cc:747-753``).
* A failed sync ``put``/``mput`` on the server side (no room) is
  ``PUT_OBJECT_FAILED`` (-2100, ``clnt_messenger.cc:692-700``); ``put_async``
  passes the server's ``DS_CACHE_POOL_ALLOC_FAILED`` (-4006) through.
* ``exists`` passes the server's code (any non-zero reads False,
  ``python/simm/kv/__init__.py:182,234``). ``delete`` passes it at HEAD
  (-4003 for a missing key, ``clnt_messenger.cc:926-928``) and answers 0 on
  every path at the tag.
* Transport failures (``local_store_down``, injected errors, a local store
  that is gone) pass through unchanged on every path: SendRPCFailed (-2300) by
  default, as HEAD reports a lost or timed-out request; the client never
  produces Timeout (-1002).
* Get's bound is the view (``local_store_get_bound=view``, the default, safe);
  ``region`` reproduces the real client, which sends the registered region's
  size as the bound (``clnt_messenger.cc:799-801``), so an object longer
  than its view is written past it and get returns the object's length.
* Keys: at most 256 UTF-8 bytes, checked by every call; an empty key is an
  ordinary key (``clnt_kv.cc:49-52`` and kin, ``consts.h:16``). Values: at
  most 64 MiB - 20 KiB, checked on puts only (``clnt_kv.cc:73-78``); zero
  bytes are not refused. One bad key or value fails a whole batch with -1000
  (``clnt_kv.cc:294-302``).
* Arguments are converted as the binding converts them: a key that is not a
  ``str`` (or not valid UTF-8) raises ``TypeError`` (nanobind's caster); a
  block that is not a ``BlockView`` raises ``AttributeError`` (the wrapper
  reads ``block._data``, ``__init__.py:247-249``); lists of different
  lengths answer -1000 for every key (``clnt_kv.cc:288-291``).

Not modelled: the real overwrite's window in which readers miss (delete,
then put), and ``exists`` answering True while a put is still copying
(``kv_rpc_service.cc:855-860``): here objects appear only when whole.

Local-store-only extras, absent from the real client (probe with ``hasattr``):
``get_flag``, ``Store.server``, ``Store.delete_prefix`` and
``Store.mput_absent`` (a batch put that skips keys already stored and
answers which, in one request: a backup without the ``mexists`` before it).

Checks done before the network, per the real client: batch-wide key and value
limits, then per entry the view's memory region: a view made from a
deregistered ``MrExt`` has no region (``INVALID_ARGUMENT``, as the real
client's "no descr ptr", ``clnt_messenger.cc:658-660``); a view outside its
live region, or whose region was deregistered after it was made, fails with
``REGISTER_MR_FAILED`` (-2203). (On the real client that last case is an
RDMA access error, not a defined code.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import os
import re
import threading
from collections.abc import Sequence

import torch

from sglang_simm.embedded import _host, _server
from sglang_simm.embedded._copy import human_bytes, wrap_memory
from sglang_simm.embedded._host import HostServer, StoreUnreachable
from sglang_simm.embedded._index import EVICTION_POLICIES
from sglang_simm.embedded._names import RENAMED_FLAGS, deprecated
from sglang_simm.embedded._server import EmbeddedServer
from sglang_simm.embedded._limits import check_warmup_prefix
from sglang_simm.embedded.contract import StoreServer
from sglang_simm.embedded.simm_rules import (
    DS_DATA_ALREADY_EXISTS,
    GET_OBJECT_FAILED,
    INVALID_ARGUMENT,
    MAX_VALUE_BYTES,
    OK,
    PUT_OBJECT_FAILED,
    REGISTER_MR_FAILED,
    SEND_RPC_FAILED,
    code_name,
    key_fits,
    keys_fit,
)

logger = logging.getLogger("sglang_simm.embedded")

# -- flags ---------------------------------------------------------------------
#
# Process-global, set with strings like gflags' SetCommandLineOption: an
# unknown name or a value that does not parse returns False and changes
# nothing. The real client's flags (src/client/clnt_flags.cc and the client
# part of src/common/flags/common_flags.cpp) are accepted and stored; only
# ``cm_primary_node_ip`` means something here: the name of the local store
# a new ``Store()`` joins. The manager port flag is ``cm_rpc_inter_port``;
# there is no ``cm_primary_node_port`` in the real client, so it is refused.
# The local store's own flags are ``local_store_*``; their old ``embedded_*``
# names (``_names.RENAMED_FLAGS``) are still read, warned, until the next
# minor release.

#: Where a Store's server lives (flag ``local_store_scope``).
SCOPES = ("process", "host")
#: SiMM's releases whose client semantics the store follows (flag
#: ``local_store_simm_release``): HEAD (3b0d7ae, 2026-04-20) or the only tag.
HEAD = "head"
TAG = "v0.1.0.post1"
RELEASES = (HEAD, TAG)

_INT_RE = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)\Z")


#: Boolean flag values, any case, surrounding blanks ignored: gflags'
#: spellings (it takes t/f, y/n) and on/off.
_TRUE_WORDS = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE_WORDS = frozenset({"false", "f", "no", "n", "off", "0"})


def _parse_bool(value: str) -> str | None:
    text = value.strip().lower()
    return "true" if text in _TRUE_WORDS else "false" if text in _FALSE_WORDS else None


def _parse_int(value: str, lo: int, hi: int) -> str | None:
    if not _INT_RE.match(value):
        return None
    number = int(value, 0) if "x" in value.lower() else int(value, 10)
    return str(number) if lo <= number <= hi else None


def _int32(value: str) -> str | None:
    return _parse_int(value, -(2**31), 2**31 - 1)


def _uint32(value: str) -> str | None:
    return None if value.startswith("-") else _parse_int(value, 0, 2**32 - 1)


def _string(value: str) -> str | None:
    return value


def _capacity(value: str) -> str | None:
    return "" if value == "" else _parse_int(value, 1, 2**63 - 1)


def _rate(value: str) -> str | None:
    try:
        rate = float(value)
    except ValueError:
        return None
    return repr(rate) if 0.0 <= rate <= 1.0 else None


def _error_code(value: str) -> str | None:
    return _parse_int(value, -32768, -1)


def _latency(value: str) -> str | None:
    try:
        latency = float(value)
    except ValueError:
        return None
    return repr(latency) if latency >= 0.0 else None  # NaN fails too


def _choice(*allowed: str):
    def parse(value: str) -> str | None:
        lowered = value.lower()
        return lowered if lowered in allowed else None

    return parse


def _seed(value: str) -> str | None:
    return "" if value == "" else _parse_int(value, -(2**63), 2**63 - 1)


def _warmup_prefix(value: str) -> str | None:
    try:
        check_warmup_prefix(value, ())
    except ValueError:
        return "" if value == "" else None
    return value


# name -> (parser returning the canonical string or None, default)
_FLAG_SPECS: dict[str, tuple] = {
    # the real client's
    "cm_primary_node_ip": (_string, ""),
    "cm_rpc_inter_port": (_int32, "30001"),
    "cm_rpc_intra_port": (_int32, "30000"),
    "cm_rpc_admin_port": (_int32, "30002"),
    "shard_total_num": (_uint32, "16384"),
    "hash_seed": (_uint32, "0"),
    "default_logging_file": (_string, "/var/log/simm/simm.log"),
    "default_logging_level": (_string, "INFO"),
    "k8s_api_server": (_string, ""),
    "k8s_service_account": (_string, ""),
    "cm_namespace": (_string, "default"),
    "cm_svc_name": (_string, "simm-clustermanager-svc"),
    "cm_port_name": (_string, "simm-clustermanager-port"),
    "clnt_use_k8s": (_parse_bool, "true"),
    "clnt_thread_pool_size": (_uint32, "10"),
    "clnt_sync_req_timeout_ms": (_int32, "1000"),
    "clnt_async_req_timeout_ms": (_int32, "3000"),
    "clnt_syncreq_enable_retry": (_parse_bool, "false"),
    "clnt_syncreq_retry_count": (_uint32, "2"),
    "clnt_cm_addr_check_interval_inSecs": (_uint32, "10"),
    "clnt_deferred_reshard_wait_inSecs": (_uint32, "30"),
    "clnt_log_file": (_string, "/var/log/simm/simm_clnt.log"),
    # the local store only: settings of the store named by cm_primary_node_ip
    # "process": the in-process local store, inside this process; "host": the
    # local store's process, one per name shared by every process of this user
    "local_store_scope": (_choice(*SCOPES), "process"),
    "local_store_dir": (_string, ""),  # host scope; "" = $SGLANG_SIMM_STORE_DIR or /dev/shm/sglang-simm-<uid>
    "local_store_capacity_bytes": (_capacity, ""),  # "" = 4 GiB capped at RAM/4
    "local_store_eviction": (_choice(*EVICTION_POLICIES), "fifo"),
    # host scope: a store this process starts exits after this many seconds
    # with no client, freeing its memory (0: never); a running store keeps its own
    "local_store_idle_exit_s": (_latency, "600.0"),
    # the SiMM release whose client semantics to follow (see the module docstring)
    "local_store_simm_release": (_choice(*RELEASES), HEAD),
    # "region": a get may write up to the end of the view's registered
    # region, as SiMM's client does; "view" (safe): only into the view
    "local_store_get_bound": (_choice("view", "region"), "view"),
    "local_store_error_rate": (_rate, "0.0"),
    "local_store_error_code": (_error_code, str(SEND_RPC_FAILED)),
    "local_store_latency_us": (_latency, "0.0"),
    "local_store_down": (_parse_bool, "false"),
    "local_store_corrupt_reads": (_rate, "0.0"),  # share of successful reads flipped
    "local_store_seed": (_seed, ""),  # "" = unseeded
    # keys that start with this prefix are counted apart as warm-ups by the
    # store (warmup_puts, warmup_hits): a client's start-up round trips, which
    # pages counted from the store's counters leave out; every Store() made
    # with it set tells its store; "" = none
    "local_store_warmup_key_prefix": (_warmup_prefix, ""),
}

_FAULT_FLAGS = {
    "local_store_error_rate": "error_rate",
    "local_store_error_code": "error_code",
    "local_store_latency_us": "latency_us",
    "local_store_down": "down",
    "local_store_corrupt_reads": "corrupt_rate",
    "local_store_seed": "seed",
}

_flags: dict[str, str] = {name: default for name, (_, default) in _FLAG_SPECS.items()}
_flags_lock = threading.Lock()

DEFAULT_SERVER_NAME = "default"
DEFAULT_CAPACITY_BYTES = 4 << 30


def set_flag(name: str, value: str) -> bool:
    """Set a process-global client flag; True if it was accepted.

    The local store's fault flags (``local_store_error_rate``,
    ``local_store_error_code``, ``local_store_latency_us``,
    ``local_store_down``, ``local_store_corrupt_reads``, ``local_store_seed``)
    also apply at once to the store named by ``cm_primary_node_ip`` if it
    exists; every ``local_store_*`` flag applies to a store when it is
    created. An old ``embedded_*`` name sets its new flag, with a warning.
    """
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError(
            f"set_flag(): incompatible function arguments: expected (str, str), "
            f"got ({type(name).__name__}, {type(value).__name__})"
        )
    name = _current_name(name)
    spec = _FLAG_SPECS.get(name)
    if spec is None:
        logger.debug("set_flag(%r): no such flag", name)
        return False
    canonical = spec[0](value)
    if canonical is None:
        logger.debug("set_flag(%r, %r): invalid value", name, value)
        return False
    with _flags_lock:
        _flags[name] = canonical
        server_name = _flags["cm_primary_node_ip"] or DEFAULT_SERVER_NAME
    if name in _FAULT_FLAGS:
        for server in (_server._SERVERS.get(server_name), _host.existing(server_name, _store_dir_flag())):
            if server is not None:
                server.faults.configure(**{_FAULT_FLAGS[name]: _fault_value(name, canonical)})
    return True


def get_flag(name: str) -> str | None:
    """A flag's current value as a string, or None for an unknown name.
    (The local store only: the real client has no getter.) An old
    ``embedded_*`` name reads its new flag, with a warning."""
    name = _current_name(name)
    with _flags_lock:
        return _flags.get(name)


def _current_name(name: str) -> str:
    """A flag's name, an old one (``RENAMED_FLAGS``) replaced by its new one, warned."""
    new = RENAMED_FLAGS.get(name)
    if new is None:
        return name
    logger.warning("SiMM local store: flag %s", deprecated(name, new))
    return new


def _fault_value(name: str, canonical: str) -> object:
    if name == "local_store_down":
        return canonical == "true"
    if name in ("local_store_error_rate", "local_store_latency_us", "local_store_corrupt_reads"):
        return float(canonical)
    if name == "local_store_seed":
        return int(canonical) if canonical else None
    return int(canonical)


def physical_memory_bytes() -> int | None:
    """Physical RAM, or the cgroup memory limit when lower; None if unknown."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            sizes.append(int(text))
    sizes = [s for s in sizes if s > 0]
    return min(sizes) if sizes else None


def default_capacity_bytes() -> int:
    """4 GiB, capped at a quarter of physical memory."""
    ram = physical_memory_bytes()
    return min(DEFAULT_CAPACITY_BYTES, ram // 4) if ram else DEFAULT_CAPACITY_BYTES


def _capacity_flag(flags: dict[str, str]) -> int:
    value = flags["local_store_capacity_bytes"]
    return int(value) if value else default_capacity_bytes()


def _store_dir_flag() -> str | None:
    return get_flag("local_store_dir") or None


def _configure_faults(server: StoreServer, flags: dict[str, str]) -> None:
    server.faults.configure(**{attr: _fault_value(flag, flags[flag]) for flag, attr in _FAULT_FLAGS.items()})


def _make_server(name: str) -> EmbeddedServer:
    with _flags_lock:
        flags = dict(_flags)
    server = EmbeddedServer(name, _capacity_flag(flags), flags["local_store_eviction"])
    _configure_faults(server, flags)
    return server


def _open_host_server(name: str) -> HostServer:
    with _flags_lock:
        flags = dict(_flags)
    known = _host.existing(name, flags["local_store_dir"] or None)
    server = _host.get_or_open(
        name,
        root=flags["local_store_dir"] or None,
        capacity=_capacity_flag(flags),
        policy=flags["local_store_eviction"],
        timeout_s=max(int(flags["clnt_sync_req_timeout_ms"]), 1) / 1000,
        idle_exit_s=float(flags["local_store_idle_exit_s"]),
    )
    if server is not known:
        _configure_faults(server, flags)
    return server


def get_server(name: str) -> StoreServer:
    """The local store called ``name`` in the current ``local_store_scope``:
    in this process (created on first use with the current ``local_store_*``
    flags), or this process's handle on the local store process of that name
    (started on first use). A local store process that cannot be
    reached raises ``StoreUnreachable`` (a ``ConnectionError``)."""
    if not isinstance(name, str):
        raise TypeError(f"server name must be a str, got {name!r}")
    name = name or DEFAULT_SERVER_NAME
    if get_flag("local_store_scope") == "host":
        return _open_host_server(name)
    return _server.get_or_create(name, _make_server)


def reset_servers(*names: str) -> None:
    """Forget the named servers (every one when no name is given), so a new
    ``Store()`` of such a name gets a fresh, empty server. In-process
    servers are dropped from the registry (clients holding one keep using
    it); local stores this process opened are stopped."""
    _server.reset_servers(*names)
    _host.forget(*names)


def server_names() -> list[str]:
    """Names of the servers this process knows (in-process and host), sorted."""
    return sorted(set(_server.server_names()) | set(_host.handle_names()))


def current_server_name() -> str:
    """The server a new ``Store()`` joins: ``cm_primary_node_ip`` or "default"."""
    return get_flag("cm_primary_node_ip") or DEFAULT_SERVER_NAME


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
    return get_flag("local_store_simm_release")


# -- the store ------------------------------------------------------------------------


class Store:
    """A client of the local store named by the ``cm_primary_node_ip``
    flag when it is made (created on first use). Stores of one name share
    their objects, like clients of one cluster."""

    __slots__ = ("_server",)

    def __init__(self) -> None:
        try:
            server = get_server(current_server_name())
        except (StoreUnreachable, OSError) as exc:
            raise RuntimeError(f"Init client messenger failed: {exc}") from exc
        if server.faults.down:
            raise RuntimeError(
                f"Init client messenger failed: {code_name(SEND_RPC_FAILED)} "
                f"(local store {server.name!r} is down)"
            )
        self._server: StoreServer = server
        warmups = get_flag("local_store_warmup_key_prefix")
        if warmups:
            server.add_warmup_prefix(warmups)

    @property
    def server(self) -> StoreServer:
        """The local store behind this client (local store only)."""
        return self._server

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
        faults = self._server.faults
        if faults.outage(1):
            return SEND_RPC_FAILED
        faults.delay()
        injected = faults.draw(1)
        if injected is not None:
            return injected[0]
        try:
            return self._server.delete(key)
        except StoreUnreachable as exc:
            return exc.code

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix`` (non-empty);
        returns how many. Local store only: SiMM's client cannot list keys.
        Nothing is deleted (0) while the server is down."""
        prefix = _as_key(prefix)
        if not prefix:
            raise ValueError("delete_prefix() needs a non-empty prefix")
        faults = self._server.faults
        if faults.outage(1):
            return 0
        faults.delay()
        try:
            return self._server.delete_prefix(prefix)
        except StoreUnreachable:
            return 0

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

    # -- the pipeline: checks, network, server ------------------------------

    def _network(self, results: list[int], live: list[int]) -> list[int]:
        """Apply the fault injector to the entries ``live`` (indexes into
        ``results``); returns those that reach the server."""
        faults = self._server.faults
        if faults.outage(len(live)):
            for i in live:
                results[i] = SEND_RPC_FAILED
            return []
        faults.delay()
        injected = faults.draw(len(live))
        if injected is None:
            return live
        reach = []
        for i, code in zip(live, injected):
            if code:
                results[i] = code
            else:
                reach.append(i)
        return reach

    def _admit(self, views: list[BlockView], results: list[int]) -> tuple[list[int], list[_Region]]:
        """Indices of the entries that reach the server (their view lies in
        registered memory and the simulated network let them through), and
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
        if not live:
            return live, pins
        return self._network(results, live), pins

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
            codes = self._server.put_from([(keys[i], views[i]._ptr, views[i]._size) for i in live], overwrite)
        except StoreUnreachable as exc:  # transport codes pass through, as injected ones do
            for i in live:
                results[i] = exc.code
            return results
        for i, code in zip(live, codes):
            # the sync client reports any server refusal but "already exists"
            # as PutObjectFailed (clnt_messenger.cc, ClientMessenger::Put)
            if code < 0 and not passthrough and code != DS_DATA_ALREADY_EXISTS:
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
        bound = _region_bound if get_flag("local_store_get_bound") == "region" else _view_bound
        try:
            codes = self._server.get_into([(keys[i], views[i]._ptr, bound(views[i])) for i in live])
        except StoreUnreachable as exc:
            for i in live:
                results[i] = exc.code
            return results
        for i, code in zip(live, codes):
            # the sync client reports every server-side get failure as
            # GetObjectFailed (clnt_messenger.cc, ClientMessenger::Get)
            results[i] = GET_OBJECT_FAILED if code < 0 and not passthrough else code
        self._corrupt([(views[i]._ptr, code) for i, code in zip(live, codes) if code > 0])
        return results

    def _corrupt(self, reads: list[tuple[int, int]]) -> None:
        """The ``local_store_corrupt_reads`` fault, after the copy: flip the top
        bit of every byte of the chosen reads' destinations. For IEEE floats
        of any width that flips a sign, an exponent or a mantissa bit of
        every value: all stay finite (barring values near the type's
        maximum), and all are wrong."""
        chosen = self._server.faults.corrupt(len(reads))
        if chosen is None:
            return
        for (ptr, size), flip in zip(reads, chosen):
            if flip:
                wrap_memory(ptr, size).bitwise_xor_(0x80)

    def _lookup(self, keys: list[str]) -> list[int]:
        n = len(keys)
        if not keys_fit(keys, empty_ok=True):
            return [INVALID_ARGUMENT] * n
        results = [OK] * n
        live = self._network(results, list(range(n)))
        if live:
            try:
                codes = self._server.lookup([keys[i] for i in live])
            except StoreUnreachable as exc:
                codes = [exc.code] * len(live)
            for i, code in zip(live, codes):
                results[i] = code
        return results

    def __repr__(self) -> str:
        return f"<Store local_store={self._server.name!r}>"


async def _in_executor(fn, *args):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, fn, *args)
