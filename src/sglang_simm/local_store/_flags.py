"""The client's flags, each parsed once into a typed value.

Process-global, set with strings as gflags' SetCommandLineOption: an unknown
name or a value that does not parse is refused and changes nothing. The
real client's flags (``src/client/clnt_flags.cc`` and the client part of
``src/common/flags/common_flags.cpp``) are accepted and stored; only
``cm_primary_node_ip`` means something here: the name of the store a new
``Store()`` joins. The local store's own flags are ``local_store_*``; their
old ``embedded_*`` names are still read, warned, until the next minor
release. The typed values are gathered in :class:`LocalStoreSettings`,
replaced as a whole on every change.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sglang_simm.local_store._limits import EVICTION_POLICIES

logger = logging.getLogger("sglang_simm.local_store")

SCOPES = ("process", "host")
#: SiMM releases whose client semantics the store follows: HEAD (3b0d7ae,
#: 2026-04-20) or the only tag.
HEAD, TAG = "head", "v0.1.0.post1"
RELEASES = (HEAD, TAG)

#: The local store's old flag names -> new (read, warned, until the next minor release).
RENAMED_FLAGS: dict[str, str] = {f"embedded_{n}": f"local_store_{n}" for n in (
    "scope", "capacity_bytes", "eviction", "idle_exit_s", "simm_release", "get_bound")}
RENAMED_FLAGS["embedded_store_dir"] = "local_store_dir"
#: Flags that simulated a network in front of the store: test instruments
#: now, outside the package (``sglang_simm_dev.faults``).
MOVED_FLAGS = frozenset(f"{p}_{n}" for p in ("local_store", "embedded") for n in (
    "error_rate", "error_code", "latency_us", "down", "corrupt_reads", "seed"))
MOVED_WHERE = ("fault injection is a test instrument now, outside the wheel: dev/sglang_simm_dev/faults.py in a "
               "clone (configure_faults, or SGLANG_SIMM_FAULTS in a server's environment)")


def deprecated(old: str, new: str) -> str:
    return f"{old} is deprecated: use {new} (the old name is read until the next minor release)"


def both_given(old: str, new: str) -> str:
    return f"both {old} (deprecated) and {new} are given: give only {new}"


_INT_RE = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)\Z")
_TRUE, _FALSE = frozenset({"true", "t", "yes", "y", "on", "1"}), frozenset({"false", "f", "no", "n", "off", "0"})


def _bool(value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"not a boolean: {value!r}")


def _int(lo: int, hi: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not _INT_RE.match(value) or (lo == 0 and value.startswith("-")):
            raise ValueError(f"not an integer in {lo}..{hi}: {value!r}")
        number = int(value, 0) if "x" in value.lower() else int(value, 10)
        if not lo <= number <= hi:
            raise ValueError(f"{number} is outside {lo}..{hi}")
        return number

    return parse


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda value: None if value == "" else parse(value)


def _non_negative(value: str) -> float:
    number = float(value)
    if not number >= 0.0:  # NaN too
        raise ValueError(f"must be >= 0, got {value!r}")
    return number


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value.lower() not in allowed:
            raise ValueError(f"{value!r} is none of {allowed}")
        return value.lower()

    return parse


def text(value: object) -> str:
    """A typed value's canonical text, as ``get_flag`` answers it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


class Flag(NamedTuple):
    parse: Callable[[str], Any]
    default: str


_int32, _uint32, _str = _int(-(2**31), 2**31 - 1), _int(0, 2**32 - 1), str
FLAGS: dict[str, Flag] = {
    # the real client's
    "cm_primary_node_ip": Flag(_str, ""),
    "cm_rpc_inter_port": Flag(_int32, "30001"),
    "cm_rpc_intra_port": Flag(_int32, "30000"),
    "cm_rpc_admin_port": Flag(_int32, "30002"),
    "shard_total_num": Flag(_uint32, "16384"),
    "hash_seed": Flag(_uint32, "0"),
    "default_logging_file": Flag(_str, "/var/log/simm/simm.log"),
    "default_logging_level": Flag(_str, "INFO"),
    "k8s_api_server": Flag(_str, ""),
    "k8s_service_account": Flag(_str, ""),
    "cm_namespace": Flag(_str, "default"),
    "cm_svc_name": Flag(_str, "simm-clustermanager-svc"),
    "cm_port_name": Flag(_str, "simm-clustermanager-port"),
    "clnt_use_k8s": Flag(_bool, "true"),
    "clnt_thread_pool_size": Flag(_uint32, "10"),
    "clnt_sync_req_timeout_ms": Flag(_int32, "1000"),
    "clnt_async_req_timeout_ms": Flag(_int32, "3000"),
    "clnt_syncreq_enable_retry": Flag(_bool, "false"),
    "clnt_syncreq_retry_count": Flag(_uint32, "2"),
    "clnt_cm_addr_check_interval_inSecs": Flag(_uint32, "10"),
    "clnt_deferred_reshard_wait_inSecs": Flag(_uint32, "30"),
    "clnt_log_file": Flag(_str, "/var/log/simm/simm_clnt.log"),
    # the local store's: LocalStoreSettings
    "local_store_scope": Flag(_choice(*SCOPES), "process"),
    "local_store_dir": Flag(_or_none(_str), ""),
    "local_store_capacity_bytes": Flag(_or_none(_int(1, 2**63 - 1)), ""),
    "local_store_eviction": Flag(_choice(*EVICTION_POLICIES), "fifo"),
    "local_store_idle_exit_s": Flag(_non_negative, "600.0"),
    "local_store_simm_release": Flag(_choice(*RELEASES), HEAD),
    "local_store_get_bound": Flag(_choice("view", "region"), "view"),
}


@dataclass(frozen=True)
class LocalStoreSettings:
    """The local store's flags, typed. ``simm_release`` and ``get_bound``
    apply on every call; the rest to a store when this process starts or
    opens it."""

    #: "host": one store process per name, shared by this user's processes;
    #: "process": a store on a thread of this process, in a directory of its own
    scope: str = "process"
    dir: str | None = None  #: None: $SGLANG_SIMM_STORE_DIR or /dev/shm/sglang-simm-<uid>
    capacity_bytes: int | None = None  #: None: 4 GiB capped at RAM/4
    eviction: str = "fifo"
    idle_exit_s: float = 600.0  #: a store this process starts exits after this long with no client (0: never)
    simm_release: str = HEAD  #: whose client semantics to follow
    get_bound: str = "view"  #: "region": a get may write to the end of the view's region, as SiMM's does
    request_timeout_s: float = 1.0  #: a request's time limit (``clnt_sync_req_timeout_ms``)


LOCAL_FIELDS = {f"local_store_{n}": n for n in ("scope", "dir", "capacity_bytes", "eviction", "idle_exit_s",
                                                 "simm_release", "get_bound")}
_values: dict[str, Any] = {name: flag.parse(flag.default) for name, flag in FLAGS.items()}
_lock = threading.Lock()


def _settings_from(values: dict[str, Any]) -> LocalStoreSettings:
    return LocalStoreSettings(**{field: values[name] for name, field in LOCAL_FIELDS.items()},
                              request_timeout_s=max(values["clnt_sync_req_timeout_ms"], 1) / 1000)


_settings = _settings_from(_values)


def local_settings() -> LocalStoreSettings:
    return _settings


def server_name() -> str:
    return _values["cm_primary_node_ip"]


def current_name(name: str) -> str:
    """A flag's name, an old one replaced by its new one (warned)."""
    new = RENAMED_FLAGS.get(name)
    if new is None:
        return name
    logger.warning("SiMM local store: flag %s", deprecated(name, new))
    return new


def set_value(name: str, value: str) -> tuple[str, Any] | None:
    """Parse and set a flag: its current name and typed value, or None."""
    global _settings
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError(f"set_flag(): incompatible function arguments: expected (str, str), "
                        f"got ({type(name).__name__}, {type(value).__name__})")
    if name in MOVED_FLAGS:
        logger.error("SiMM local store: flag %s is refused: %s", name, MOVED_WHERE)
        return None
    name = current_name(name)
    flag = FLAGS.get(name)
    if flag is None:
        return None
    try:
        typed = flag.parse(value)
    except (TypeError, ValueError) as exc:
        logger.debug("set_flag(%r, %r): invalid value (%s)", name, value, exc)
        return None
    with _lock:
        _values[name] = typed
        _settings = _settings_from(_values)
    return name, typed


def get_flag(name: str) -> str | None:
    """A flag's value as text, or None for an unknown name (local store only)."""
    name = current_name(name)
    with _lock:
        return text(_values[name]) if name in _values else None
