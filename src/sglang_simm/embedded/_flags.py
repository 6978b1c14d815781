"""The client's flags, each parsed once into a typed value.

Process-global, set with strings like gflags' SetCommandLineOption: an
unknown name or a value that does not parse is refused and changes nothing.
The real client's flags (src/client/clnt_flags.cc and the client part of
src/common/flags/common_flags.cpp) are accepted and stored; only
``cm_primary_node_ip`` means something here: the name of the local store a
new ``Store()`` joins. The manager port flag is ``cm_rpc_inter_port``; there
is no ``cm_primary_node_port`` in the real client, so it is refused. The
local store's own flags are ``local_store_*``; their old ``embedded_*``
names (``_names.RENAMED_FLAGS``) are still read, warned, until the next
minor release.

A flag's text is parsed once, when it is set; what the store uses are the
typed values, gathered in two frozen snapshots replaced as a whole on
every change: :class:`LocalStoreSettings` (how a store is made and how the
client follows SiMM) and ``_faults.FaultSettings`` (the simulated network a
store gets when it is made). ``get_flag`` writes a value back in its
canonical text.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sglang_simm.embedded._faults import FaultSettings, check_code, check_non_negative, check_rate
from sglang_simm.embedded._index import EVICTION_POLICIES
from sglang_simm.embedded._limits import check_warmup_prefix
from sglang_simm.embedded._names import RENAMED_FLAGS, deprecated
from sglang_simm.embedded.simm_rules import SEND_RPC_FAILED

logger = logging.getLogger("sglang_simm.embedded")

#: Where a Store's server lives (flag ``local_store_scope``).
SCOPES = ("process", "host")
#: SiMM's releases whose client semantics the store follows (flag
#: ``local_store_simm_release``): HEAD (3b0d7ae, 2026-04-20) or the only tag.
HEAD = "head"
TAG = "v0.1.0.post1"
RELEASES = (HEAD, TAG)

# -- parsers: text -> typed value, ValueError if the text is none ------------------------

_INT_RE = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)\Z")

#: Boolean flag values, any case, surrounding blanks ignored: gflags'
#: spellings (it takes t/f, y/n) and on/off.
_TRUE_WORDS = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE_WORDS = frozenset({"false", "f", "no", "n", "off", "0"})


def _bool(value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE_WORDS:
        return True
    if text in _FALSE_WORDS:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _int(lo: int, hi: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not _INT_RE.match(value):
            raise ValueError(f"not an integer: {value!r}")
        number = int(value, 0) if "x" in value.lower() else int(value, 10)
        if not lo <= number <= hi:
            raise ValueError(f"{number} is outside {lo}..{hi}")
        return number

    return parse


_int16 = _int(-(2**15), 2**15 - 1)
_int32 = _int(-(2**31), 2**31 - 1)
_int64 = _int(-(2**63), 2**63 - 1)
_uint32_range = _int(0, 2**32 - 1)


def _uint32(value: str) -> int:
    if value.startswith("-"):  # "-0" too
        raise ValueError(f"not unsigned: {value!r}")
    return _uint32_range(value)


def _string(value: str) -> str:
    return value


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, with "" for None (the flag's default, decided elsewhere)."""
    return lambda value: None if value == "" else parse(value)


def _rate(value: str) -> float:
    return check_rate(float(value), "rate")  # float(): ValueError for a non-number


def _non_negative(value: str) -> float:
    return check_non_negative(float(value), "value")


def _error_code(value: str) -> int:
    return check_code(_int16(value))


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        lowered = value.lower()
        if lowered not in allowed:
            raise ValueError(f"{value!r} is none of {allowed}")
        return lowered

    return parse


def _warmup_prefix(value: str) -> str:
    if value:
        check_warmup_prefix(value, ())
    return value


def text(value: object) -> str:
    """A typed value's canonical text, as ``get_flag`` answers it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# -- the flags ---------------------------------------------------------------------------


class Flag(NamedTuple):
    parse: Callable[[str], Any]
    #: the default, as ``set_flag`` takes it
    default: str


FLAGS: dict[str, Flag] = {
    # the real client's
    "cm_primary_node_ip": Flag(_string, ""),
    "cm_rpc_inter_port": Flag(_int32, "30001"),
    "cm_rpc_intra_port": Flag(_int32, "30000"),
    "cm_rpc_admin_port": Flag(_int32, "30002"),
    "shard_total_num": Flag(_uint32, "16384"),
    "hash_seed": Flag(_uint32, "0"),
    "default_logging_file": Flag(_string, "/var/log/simm/simm.log"),
    "default_logging_level": Flag(_string, "INFO"),
    "k8s_api_server": Flag(_string, ""),
    "k8s_service_account": Flag(_string, ""),
    "cm_namespace": Flag(_string, "default"),
    "cm_svc_name": Flag(_string, "simm-clustermanager-svc"),
    "cm_port_name": Flag(_string, "simm-clustermanager-port"),
    "clnt_use_k8s": Flag(_bool, "true"),
    "clnt_thread_pool_size": Flag(_uint32, "10"),
    "clnt_sync_req_timeout_ms": Flag(_int32, "1000"),
    "clnt_async_req_timeout_ms": Flag(_int32, "3000"),
    "clnt_syncreq_enable_retry": Flag(_bool, "false"),
    "clnt_syncreq_retry_count": Flag(_uint32, "2"),
    "clnt_cm_addr_check_interval_inSecs": Flag(_uint32, "10"),
    "clnt_deferred_reshard_wait_inSecs": Flag(_uint32, "30"),
    "clnt_log_file": Flag(_string, "/var/log/simm/simm_clnt.log"),
    # the local store only: LocalStoreSettings (see there)
    "local_store_scope": Flag(_choice(*SCOPES), "process"),
    "local_store_dir": Flag(_or_none(_string), ""),
    "local_store_capacity_bytes": Flag(_or_none(_int(1, 2**63 - 1)), ""),
    "local_store_eviction": Flag(_choice(*EVICTION_POLICIES), "fifo"),
    "local_store_idle_exit_s": Flag(_non_negative, "600.0"),
    "local_store_simm_release": Flag(_choice(*RELEASES), HEAD),
    "local_store_get_bound": Flag(_choice("view", "region"), "view"),
    "local_store_warmup_key_prefix": Flag(_warmup_prefix, ""),
    # the local store's faults: FaultSettings
    "local_store_error_rate": Flag(_rate, "0.0"),
    "local_store_error_code": Flag(_error_code, str(SEND_RPC_FAILED)),
    "local_store_latency_us": Flag(_non_negative, "0.0"),
    "local_store_down": Flag(_bool, "false"),
    "local_store_corrupt_reads": Flag(_rate, "0.0"),
    "local_store_seed": Flag(_or_none(_int64), ""),
}


@dataclass(frozen=True)
class LocalStoreSettings:
    """The local store's flags but the faults, typed. ``simm_release`` and
    ``get_bound`` apply on every call; ``scope`` and ``warmup_key_prefix``
    to every ``Store()`` made; the rest to a store when this process makes
    or opens it."""

    #: "process": the in-process local store, inside this process; "host":
    #: the local store's process, one per name shared by every process of this user
    scope: str = "process"
    #: host scope; None: $SGLANG_SIMM_STORE_DIR or /dev/shm/sglang-simm-<uid>
    dir: str | None = None
    #: None: 4 GiB capped at RAM/4 (``default_capacity_bytes``)
    capacity_bytes: int | None = None
    eviction: str = "fifo"
    #: host scope: a store this process starts exits after this many
    #: seconds with no client, freeing its memory (0: never); a running
    #: store keeps its own
    idle_exit_s: float = 600.0
    #: keys that start with this prefix are counted apart as warm-ups by the
    #: store (warmup_puts, warmup_hits): a client's start-up round trips,
    #: which pages counted from the store's counters leave out; every
    #: Store() made with it set tells its store; "" = none
    warmup_key_prefix: str = ""
    #: the SiMM release whose client semantics to follow (the client module's docstring)
    simm_release: str = HEAD
    #: "region": a get may write up to the end of the view's registered
    #: region, as SiMM's client does; "view" (safe): only into the view
    get_bound: str = "view"
    #: a host store's time limit per request (``clnt_sync_req_timeout_ms``,
    #: at least 1 ms)
    request_timeout_s: float = 1.0


#: flag -> its field of LocalStoreSettings
LOCAL_FIELDS = {
    "local_store_scope": "scope",
    "local_store_dir": "dir",
    "local_store_capacity_bytes": "capacity_bytes",
    "local_store_eviction": "eviction",
    "local_store_idle_exit_s": "idle_exit_s",
    "local_store_warmup_key_prefix": "warmup_key_prefix",
    "local_store_simm_release": "simm_release",
    "local_store_get_bound": "get_bound",
}
#: flag -> its field of FaultSettings
FAULT_FIELDS = {
    "local_store_error_rate": "error_rate",
    "local_store_error_code": "error_code",
    "local_store_latency_us": "latency_us",
    "local_store_down": "down",
    "local_store_corrupt_reads": "corrupt_rate",
    "local_store_seed": "seed",
}

_values: dict[str, Any] = {name: flag.parse(flag.default) for name, flag in FLAGS.items()}
_lock = threading.Lock()


def _local_from(values: dict[str, Any]) -> LocalStoreSettings:
    return LocalStoreSettings(
        **{field: values[name] for name, field in LOCAL_FIELDS.items()},
        request_timeout_s=max(values["clnt_sync_req_timeout_ms"], 1) / 1000,
    )


def _faults_from(values: dict[str, Any]) -> FaultSettings:
    return FaultSettings(**{field: values[name] for name, field in FAULT_FIELDS.items()})


_local_settings = _local_from(_values)
_fault_settings = _faults_from(_values)


def local_settings() -> LocalStoreSettings:
    """The local store's settings now (one attribute load: cheap per call)."""
    return _local_settings


def fault_settings() -> FaultSettings:
    """The faults a store gets when this process makes or opens it."""
    return _fault_settings


def server_name() -> str:
    """``cm_primary_node_ip``: the store a new ``Store()`` joins ("" = the default one)."""
    return _values["cm_primary_node_ip"]


def set_value(name: str, value: str) -> tuple[str, Any] | None:
    """Parse and set a flag: its current name and typed value, or None (an
    unknown name, a value that does not parse: nothing changed)."""
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError(
            f"set_flag(): incompatible function arguments: expected (str, str), "
            f"got ({type(name).__name__}, {type(value).__name__})"
        )
    name = current_name(name)
    flag = FLAGS.get(name)
    if flag is None:
        logger.debug("set_flag(%r): no such flag", name)
        return None
    try:
        typed = flag.parse(value)
    except (TypeError, ValueError) as exc:
        logger.debug("set_flag(%r, %r): invalid value (%s)", name, value, exc)
        return None
    global _local_settings, _fault_settings
    with _lock:
        _values[name] = typed
        if name in LOCAL_FIELDS or name == "clnt_sync_req_timeout_ms":
            _local_settings = _local_from(_values)
        elif name in FAULT_FIELDS:
            _fault_settings = _faults_from(_values)
    return name, typed


def get_flag(name: str) -> str | None:
    """A flag's current value as a string, or None for an unknown name.
    (The local store only: the real client has no getter.) An old
    ``embedded_*`` name reads its new flag, with a warning."""
    name = current_name(name)
    with _lock:
        if name not in _values:
            return None
        return text(_values[name])


def current_name(name: str) -> str:
    """A flag's name, an old one (``RENAMED_FLAGS``) replaced by its new one, warned."""
    new = RENAMED_FLAGS.get(name)
    if new is None:
        return name
    logger.warning("SiMM local store: flag %s", deprecated(name, new))
    return new
