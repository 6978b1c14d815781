"""Configuration of the SiMM HiCache backend: one frozen dataclass, three sources.

Sources, highest priority first (``SOURCES``, written once):

1. ``extra_config``: the dict SGLang hands the backend as
   ``storage_config.extra_config`` (from ``--hicache-storage-backend-extra-config``);
2. a JSON object in the file named by ``SGLANG_HICACHE_SIMM_CONFIG_PATH``;
3. the environment: ``SIMM_CLUSTER_MANAGER`` for the manager address and
   ``SGLANG_SIMM_<FIELD>`` for every field (``SGLANG_SIMM_KEY_SCHEME``, ...).

Each source is a function returning a partial dict; they are merged field by
field (``client_flags`` flag by flag), the source of every field is kept for
logs and ``doctor``, and everything is validated once, after merging
(``_validate``), so every error names the field, the value, what is accepted
and where the value came from.

Renamed fields (``RENAMED_FIELDS``) and the local store's renamed client
flags (``RENAMED_FLAGS``) are still read under their old names, each with a
warning naming the new one, until the next minor release; an old and a new
name of one setting in one source is an error naming both.

Importing this module is cheap: the standard library and pure modules only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import ipaddress
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.events_config import KVEventsSettings, parse_kv_events
from sglang_simm.keys import KEY_SCHEMES, KeyScheme
from sglang_simm.values import InvalidValue, parse_bool, parse_byte_size

from sglang_simm.local_store.admin import MOVED_FLAGS, MOVED_WHERE, RENAMED_FLAGS, STORE_DIR_ENV, both_given
from sglang_simm.local_store.admin import NAME_RE as STORE_NAME_RE, NAME_RULE as STORE_NAME_RULE
from sglang_simm.local_store.admin import deprecated, store_dir

__all__ = [
    "CONFIG_PATH_ENV",
    "ENV_PREFIX",
    "LOG_DIR_ENV",
    "MANAGER_ENV",
    "OTHER_ENV_VARS",
    "RENAMED_FIELDS",
    "RENAMED_FLAGS",
    "SGLANG_EXTRA_CONFIG_KEYS",
    "SOURCES",
    "FlagMap",
    "ResolvedConfig",
    "SiMMConfig",
    "UnknownKey",
    "default_log_file",
    "find_deprecated_names",
    "find_unknown_keys",
    "load_config",
    "local_store_place",
    "log_resolved",
    "parse_byte_size",
    "quiet",
    "with_current_names",
]

logger = logging.getLogger("sglang_simm.config")

#: Env var naming a JSON file with the config (the in-tree backend's name, kept).
CONFIG_PATH_ENV = "SGLANG_HICACHE_SIMM_CONFIG_PATH"
#: Env var with the manager address (the name SiMM's own docs use).
MANAGER_ENV = "SIMM_CLUSTER_MANAGER"
#: Prefix of the per-field env vars: ``SGLANG_SIMM_<FIELD_UPPER>``.
ENV_PREFIX = "SGLANG_SIMM_"
#: Env var with the directory for the default per-process client log.
LOG_DIR_ENV = "SGLANG_SIMM_LOG_DIR"
#: The variables of this package that are not a field's (the store's directory
#: and metrics endpoint among them): a near miss of one is reported, and none
#: of them is taken for a near miss.
OTHER_ENV_VARS: tuple[str, ...] = (
    MANAGER_ENV,
    CONFIG_PATH_ENV,
    LOG_DIR_ENV,
    STORE_DIR_ENV,
    "SGLANG_SIMM_STORE_METRICS_PORT",
    "SGLANG_SIMM_STORE_METRICS_HOST",
)

#: Fields renamed, old name -> new name (read as the module docstring says).
RENAMED_FIELDS: dict[str, str] = {"embedded_capacity_bytes": "local_store_capacity_bytes"}

#: Keys SGLang itself reads from (or puts into) ``extra_config``. They share the
#: dict with ours, so they are accepted silently, never warned about.
SGLANG_EXTRA_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        # the dynamic route's fields (backend_factory.py, cache_controller.py)
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # popped by SGLang's controller and radix caches before the backend sees them
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        # read or set by SGLang 0.5.23 (pool_host/common.py, unified_radix_cache.py)
        "allocator",
        "file_storage_path",
    }
)

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_FLAG_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE_RE = re.compile(r"[A-Za-z0-9._:-]+")
_INT_RE = re.compile(r"[+-]?\d+")
_LOCAL_STORE_DEFAULT_NAME = "default"
#: Local store address forms -> where its store runs (client flag
#: ``local_store_scope``): one store process per name per host, or a thread
#: of this process (``inprocess``, deprecated: its ranks cannot share it).
_LOCAL_STORE_FORMS = {"local": "host", "inprocess": "process"}


class FlagMap(Mapping[str, str]):
    """A read-only, hashable ``str -> str`` mapping (``client_flags``)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._items: dict[str, str] = dict(sorted((items or {}).items()))

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:  # equality is Mapping's: equal to any mapping of the same items
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return f"FlagMap({self._items!r})"


@dataclass(frozen=True)
class SiMMConfig:
    """Everything the SiMM backend is configured with: from :func:`load_config`
    (all sources), :meth:`from_mapping` (one dict), or built directly (validated too)."""

    manager_address: str
    """``host:port``, ``[ipv6]:port``; ``local`` or ``local://NAME`` (the local
    store: one store process per name, shared by every process of this user
    on this host); ``inprocess`` or ``inprocess://NAME`` (the in-process local
    store: inside this process only, for tests and single-process tools)."""

    clnt_threadpool_size: int = 10
    """Threads of the SiMM client (flag ``clnt_thread_pool_size``), 1..1024."""

    enable_profile: bool = False
    """Log size, time and throughput of every batch call."""

    extra_backend_tag: str | None = None
    """A tag put into every key, to keep deployments sharing one cluster apart."""

    rdma_devices: tuple[str, ...] | None = None
    """RDMA devices to use (``SICL_NET_DEVICES``); None picks them by NUMA node."""

    numa_aware: bool = True
    """Pick the NICs on this process's NUMA node; off: every ACTIVE NIC."""

    numa_node: int | None = None
    """Force the NUMA node used to pick NICs; None works it out."""

    request_timeout_ms: int = 1000
    """Timeout of one synchronous client request (``clnt_sync_req_timeout_ms``)."""

    log_file: str | None = None
    """The SiMM client's log file; None: :func:`default_log_file`."""

    client_flags: Mapping[str, str] = field(default_factory=FlagMap)
    """Raw SiMM client flags, passed to ``set_flag`` as given (values as text)."""

    local_store_capacity_bytes: int | None = None
    """Capacity of the local store when this process starts it; accepts
    ``"512MiB"`` etc.; None: 4 GiB on memory (at most a quarter of RAM),
    half of what is free on a disk. A running store keeps its own."""

    local_store_dir: str | None = None
    """The local store's directory: any local filesystem, memory (tmpfs) or a
    disk; None: ``$SGLANG_SIMM_STORE_DIR``, else ``/dev/shm/sglang-simm-<uid>``.
    On a disk the store is kept across restarts and may exceed RAM."""

    key_scheme: KeyScheme = "namespaced"
    """``namespaced``: keys carry model and layout; ``legacy``: the in-tree keys."""

    warmup: bool = True
    """Do a put/exists/get round trip at start, so a broken path fails early."""

    breaker_enabled: bool = True
    """Fail fast while the store is down (``sglang_simm.breaker``): without
    it a hung store costs every request up to ``request_timeout_ms``; off
    only to see the raw faults while debugging."""

    breaker_threshold: int = 5
    """Faults in a row (timeouts, transport and routing failures; never a
    miss) that open the breaker, 1..1000: one lost request or a data server
    restarting must not switch L3 off for everyone."""

    breaker_backoff_ms: int = 1000
    """Wait before the first probe after the breaker opens, doubled after
    each failed probe, 1..3,600,000."""

    breaker_backoff_max_ms: int = 30000
    """The longest wait between probes, at least ``breaker_backoff_ms``,
    at most 3,600,000: L3 is back within it (plus one call) of the store
    coming back. Jitter only shortens a wait, so this is a hard bound."""

    breaker_jitter: float = 0.2
    """Share by which each wait is shortened at random, 0 <= x < 1, so the
    ranks whose breakers opened together do not all probe at once."""

    kv_events: KVEventsSettings | None = None
    """Announce what L3 gains and loses as SGLang KV events, on a ZeroMQ
    stream of this server's own beside SGLang's ``--kv-events-config`` one,
    in its shape (``events_config.KVEventsSettings``; docs/kv-events.md).
    Off by default; ``{"publisher": "zmq"}`` turns it on."""

    def __post_init__(self) -> None:
        # load_config's validation, so a hand-built config obeys the same rules
        raw = {f.name: (getattr(self, f.name), "SiMMConfig()") for f in dataclasses.fields(self)}
        for name, value in _validate(raw).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "mapping") -> SiMMConfig:
        """Build from one dict of field values (no file, no environment);
        unknown keys are warned about, SGLang's own ignored."""
        if not isinstance(data, Mapping):
            raise ValueError(f"SiMM config from {source} must be a mapping, got {type(data).__name__}")
        partial = _fields_of(data, source)
        return cls(**_validate(partial))

    @property
    def embedded_capacity_bytes(self) -> int:
        """Deprecated: :attr:`local_store_capacity_bytes` (read until the next minor release)."""
        logger.warning("SiMM config: %s", deprecated("SiMMConfig.embedded_capacity_bytes",
                                                     "SiMMConfig.local_store_capacity_bytes"))
        return self.local_store_capacity_bytes

    @property
    def is_local_store(self) -> bool:
        """True for ``local``/``inprocess`` addresses (the local store): no cluster."""
        return _parse_address(self.manager_address)[0] != "cluster"

    @property
    def local_store_scope(self) -> str | None:
        """``"host"`` (``local``), ``"process"`` (``inprocess``), None for a cluster."""
        kind = _parse_address(self.manager_address)[0]
        return None if kind == "cluster" else kind

    @property
    def local_store_name(self) -> str | None:
        """The local store's name (``default`` when none is given); None for a cluster."""
        kind, name, _port = _parse_address(self.manager_address)
        return None if kind == "cluster" else name

    @property
    def host(self) -> str | None:
        """The manager host (IPv6 without brackets); None on the local store."""
        kind, host, _port = _parse_address(self.manager_address)
        return host if kind == "cluster" else None

    @property
    def port(self) -> int | None:
        """The manager port; None on the local store."""
        return _parse_address(self.manager_address)[2]

    @property
    def effective_log_file(self) -> str:
        """``log_file``, or this process's default path when it is None."""
        return self.log_file or default_log_file()


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SiMMConfig))
assert set(RENAMED_FIELDS.values()) <= set(FIELD_NAMES) and not set(RENAMED_FIELDS) & set(FIELD_NAMES)

_dataclass_init = SiMMConfig.__init__


def _init_with_old_names(self: SiMMConfig, *args: Any, **kwargs: Any) -> None:
    """``SiMMConfig(embedded_capacity_bytes=...)`` still builds, warned, until the next minor release."""
    for old, new in RENAMED_FIELDS.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(f"SiMM config: {both_given(old, new)}")
            logger.warning("SiMM config: %s", deprecated(old, new))
            kwargs[new] = kwargs.pop(old)
    _dataclass_init(self, *args, **kwargs)


_init_with_old_names.__wrapped__ = _dataclass_init  # type: ignore[attr-defined]
SiMMConfig.__init__ = _init_with_old_names  # type: ignore[method-assign]
_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)  # type: ignore[misc]
    for f in dataclasses.fields(SiMMConfig)
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
}


@dataclass(frozen=True)
class ResolvedConfig:
    """A config plus where each of its fields came from."""

    config: SiMMConfig
    """The validated config."""

    sources: Mapping[str, str]
    """Field -> ``"extra_config"``, ``"file:/path"``, ``"env:NAME"`` or ``"default"``."""

    def describe(self) -> list[tuple[str, Any, str]]:
        """``(field, value, source)`` for every field, in declaration order;
        ``log_file`` shows the effective path when it defaults. No field is
        secret: values are shown as they are."""
        rows = []
        for name in FIELD_NAMES:
            value = getattr(self.config, name)
            if name == "log_file" and value is None:
                value = self.config.effective_log_file
            shown = dict(value) if isinstance(value, FlagMap) else \
                dataclasses.asdict(value) if isinstance(value, KVEventsSettings) else value
            rows.append((name, shown, self.sources.get(name, "default")))
        return rows


#: What each source returns: {field: (raw value, source label)}
Sourced = dict[str, tuple[Any, str]]
SourceFn = Callable[[Mapping[str, Any] | None, Mapping[str, str]], Sourced]


@dataclass(frozen=True)
class UnknownKey:
    """A key of a config source that is neither ours nor SGLang's: ignored."""

    key: str
    #: ``"extra_config"`` or ``"file:/path"``
    source: str
    #: the closest valid field name, if one is close
    suggestion: str | None

    @property
    def near_miss(self) -> bool:
        """A misspelling of a name of ours: the setting meant silently does not apply."""
        return self.suggestion is not None

    def message(self) -> str:
        """One sentence, ending in its own punctuation (a suggestion's "?")."""
        if self.source == "the environment":
            return f"unknown variable {self.key} in {self.source} is ignored; did you mean {self.suggestion}?"
        if self.suggestion:
            return f"unknown key {self.key!r} in {self.source} is ignored; did you mean {self.suggestion!r}?"
        return f"unknown key {self.key!r} in {self.source} is ignored (valid keys: {', '.join(FIELD_NAMES)})."


def unknown_keys_of(data: Mapping[str, Any], where: str) -> list[UnknownKey]:
    """The keys of ``data`` that no one reads: not a field (nor a field's
    old name, ``RENAMED_FIELDS``), not SGLang's. A near miss of an old name
    suggests the new one."""
    candidates = {**{name: name for name in FIELD_NAMES}, **RENAMED_FIELDS}
    out = []
    for key in data:
        if key in candidates or key in SGLANG_EXTRA_CONFIG_KEYS:
            continue
        close = difflib.get_close_matches(str(key), candidates, n=1)
        out.append(UnknownKey(str(key), where, candidates[close[0]] if close else None))
    return out


def _our_env_vars() -> dict[str, str]:
    """Every variable this package reads, by its own name; a field's old
    name (``RENAMED_FIELDS``) names the new one."""
    out = {var: var for var in OTHER_ENV_VARS}
    out.update({env_var_name(f): env_var_name(f) for f in FIELD_NAMES})
    out.update({env_var_name(old): env_var_name(new) for old, new in RENAMED_FIELDS.items()})
    return out


def unknown_env_vars(environ: Mapping[str, str]) -> list[UnknownKey]:
    """Variables with ``SIMM`` in their name that are a near miss of one of
    ours (``SIMM_CLUSTER_MANGER``) or one of ours in another case (variables
    are case-sensitive), each with the right name; other ``SGLANG_SIMM_*``
    variables belong to the tools and the tests."""
    ours = _our_env_vars()
    prefixed = {var[len(ENV_PREFIX):]: var for var in ours if var.startswith(ENV_PREFIX)}
    whole = {var: var for var in ours if not var.startswith(ENV_PREFIX)}
    out = []
    for var in environ:
        upper = var.upper()
        if var in ours or "SIMM" not in upper:
            continue
        if upper in ours:
            close = [upper]
        elif upper.startswith(ENV_PREFIX):
            # the suffix alone: the shared prefix would make every pair look alike
            close = [prefixed[c] for c in difflib.get_close_matches(upper[len(ENV_PREFIX):], prefixed, n=1, cutoff=0.8)]
        else:
            close = difflib.get_close_matches(upper, whole, n=1, cutoff=0.8)
        if close:
            out.append(UnknownKey(var, "the environment", ours[close[0]]))
    return out


def _readable_sources(extra_config: Any, env: Mapping[str, str]) -> list[tuple[Mapping[str, Any], str]]:
    """The extra config and the JSON file with their labels, each where it
    can be read (``load_config`` reports the others)."""
    named = [(extra_config, "extra_config")] if isinstance(extra_config, Mapping) else []
    try:
        in_file = _read_json_file(env)
    except ValueError:
        in_file = None
    return named + ([in_file] if in_file is not None else [])


def find_unknown_keys(
    extra_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> list[UnknownKey]:
    """Every ignored key of the extra config, the JSON file and the
    environment, without logging (for ``doctor``)."""
    env = os.environ if environ is None else environ
    found = [u for data, where in _readable_sources(extra_config, env) for u in unknown_keys_of(data, where)]
    return found + unknown_env_vars(env)


def find_deprecated_names(
    extra_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """One line per old name (``RENAMED_FIELDS``, ``RENAMED_FLAGS``) that
    the extra config, the JSON file or the environment still uses, naming
    the new one, without logging (for ``doctor``)."""
    env = os.environ if environ is None else environ
    found: list[str] = []
    for data, where in _readable_sources(extra_config, env):
        found += [f"{deprecated(old, new)} (in {where})" for old, new in RENAMED_FIELDS.items() if old in data]
        try:
            flags = _raw_client_flags(data.get("client_flags"))
        except InvalidValue:
            continue
        found += [f"client flag {deprecated(old, new)} (in {where})"
                  for old, new in RENAMED_FLAGS.items() if old in flags]
    found += [f"{deprecated(env_var_name(old), env_var_name(new))} (in the environment)"
              for old, new in RENAMED_FIELDS.items() if (env.get(env_var_name(old)) or "").strip()]
    try:
        flags = _raw_client_flags(env.get(env_var_name("client_flags")) or None)
    except InvalidValue:
        flags = {}
    found += [f"client flag {deprecated(old, new)} (in {env_var_name('client_flags')})"
              for old, new in RENAMED_FLAGS.items() if old in flags]
    return found


def with_current_names(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_config`` with every old field and client flag name
    (``RENAMED_FIELDS``, ``RENAMED_FLAGS``) replaced by its new one, without
    logging (for launch lines to copy). Where old and new are both given, it
    is returned as it is (``load_config`` refuses it)."""
    out = dict(extra_config)
    for old, new in RENAMED_FIELDS.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
    flags = out.get("client_flags")
    if isinstance(flags, str):
        try:
            flags = json.loads(flags)
        except json.JSONDecodeError:
            return out
    if isinstance(flags, Mapping) and any(old in flags for old in RENAMED_FLAGS):
        if not any(old in flags and new in flags for old, new in RENAMED_FLAGS.items()):
            out["client_flags"] = {RENAMED_FLAGS.get(k, k): v for k, v in flags.items()}
    return out


#: True while the sources are read for one value, not to resolve the config
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_simm_config_quiet", default=False)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Read the sources without their warnings (an unknown key, an old
    name): whoever resolves the whole config says them, once."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _warn(text: str, *args: Any) -> None:
    if not _QUIET.get():
        logger.warning(text, *args)


def _fields_of(data: Mapping[str, Any], where: str) -> Sourced:
    """Our fields out of ``data``, labelled ``where``; SGLang's keys skipped,
    others warned about; an old field name read as its new one, warned about."""
    for unknown in unknown_keys_of(data, where):
        _warn("SiMM config: %s", unknown.message())
    out = {key: (value, where) for key, value in data.items() if key in FIELD_NAMES}
    for old, new in RENAMED_FIELDS.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"SiMM config: {where}: {both_given(old, new)}")
        _warn("SiMM config: %s (in %s)", deprecated(old, new), where)
        out[new] = (data[old], where)
    return out


def _from_extra_config(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Sourced:
    if extra_config is None:
        return {}
    if not isinstance(extra_config, Mapping):
        raise ValueError(
            f"extra_config must be a JSON object (a dict), got {type(extra_config).__name__}: "
            f"{extra_config!r}; pass --hicache-storage-backend-extra-config '{{\"manager_address\": ...}}'"
        )
    return _fields_of(extra_config, "extra_config")


def _read_json_file(environ: Mapping[str, str]) -> tuple[dict[str, Any], str] | None:
    """The object in the file named by ``CONFIG_PATH_ENV`` and its source
    label, or None when the variable is unset; ValueError when broken."""
    path = environ.get(CONFIG_PATH_ENV, "").strip()
    if not path:
        return None

    def bad(problem: str) -> ValueError:
        return ValueError(f"SiMM config file {path!r} (named by {CONFIG_PATH_ENV}) {problem}; fix the file (a "
                          f'JSON object, e.g. {{"manager_address": "10.0.0.1:30001"}}) or unset {CONFIG_PATH_ENV}')

    try:
        with open(path, encoding="utf-8") as fin:
            text = fin.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise bad(f"cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad(f"must hold a JSON object, got {type(data).__name__}")
    return data, f"file:{path}"


def _from_json_file(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Sourced:
    named = _read_json_file(environ)
    if named is None:
        return {}
    return _fields_of(*named)


def _from_environ(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Sourced:
    for unknown in unknown_env_vars(environ):
        _warn("SiMM config: %s", unknown.message())
    out: Sourced = {}
    # SGLANG_SIMM_MANAGER_ADDRESS comes later, so it wins over SIMM_CLUSTER_MANAGER.
    for name, var in [("manager_address", MANAGER_ENV)] + [(f, env_var_name(f)) for f in FIELD_NAMES]:
        value = environ.get(var)
        if value and value.strip():  # set to "" or blanks: treated as unset
            out[name] = (value, f"env:{var}")
    for old, new in RENAMED_FIELDS.items():
        old_var, new_var = env_var_name(old), env_var_name(new)
        value = environ.get(old_var)
        if not (value and value.strip()):
            continue
        if new in out:
            raise ValueError(f"SiMM config: the environment: {both_given(old_var, new_var)}")
        _warn("SiMM config: %s", deprecated(old_var, new_var))
        out[new] = (value, f"env:{old_var}")
    return out


def env_var_name(field_name: str) -> str:
    """``key_scheme`` -> ``SGLANG_SIMM_KEY_SCHEME``."""
    return ENV_PREFIX + field_name.upper()


#: The sources, highest priority first. The one place precedence is written.
SOURCES: tuple[tuple[str, SourceFn], ...] = (
    ("extra_config", _from_extra_config),
    ("file", _from_json_file),
    ("env", _from_environ),
)


def _merge(partials: list[Sourced]) -> Sourced:
    """Merge partial dicts, highest priority first: the first to set a field wins,
    except ``client_flags``, merged flag by flag (the higher source wins a flag)."""
    merged: Sourced = {}
    flag_parts: list[tuple[dict[str, str], str]] = []
    for partial in partials:
        for name, (value, source) in partial.items():
            if name == "client_flags":
                try:
                    flag_parts.append((parse_client_flags(value, where=source), source))
                except InvalidValue as exc:
                    raise ValueError(_problem(name, value, source, exc)) from None
            elif name not in merged:
                merged[name] = (value, source)
    if flag_parts:  # lowest first, so a higher source's flag overwrites
        flags = {name: value for part, _source in reversed(flag_parts) for name, value in part.items()}
        merged["client_flags"] = (FlagMap(flags), ", ".join(s for _p, s in flag_parts))
    return merged


def client_flag(extra_config: Mapping[str, Any] | None, name: str,
                environ: Mapping[str, str] | None = None) -> str | None:
    """The client flag ``name`` as the highest config source that sets it
    gives it (None: none does, or a source is broken, which ``load_config``
    then reports), without resolving the rest of the config. The local
    store's flags are read under their old names too (``RENAMED_FLAGS``)."""
    env = os.environ if environ is None else environ
    name = RENAMED_FLAGS.get(name, name)
    with quiet():  # load_config says what is amiss in the sources, once
        for _source, read in SOURCES:
            try:
                flags = read(extra_config or {}, env).get("client_flags")
                value = parse_client_flags(flags[0], warn=False).get(name) if flags else None
            except Exception:
                return None
            if value:
                return value
    return None


def with_client_flag(extra_config: Mapping[str, Any], name: str, value: str) -> dict[str, Any]:
    """``extra_config`` with client flag ``name`` set to ``value``: the extra
    config is the highest source, so it wins over every other. An old name
    of the local store's flags (``RENAMED_FLAGS``) is written as the new."""
    flags = parse_client_flags(extra_config.get("client_flags"), warn=False)
    return {**extra_config, "client_flags": {**flags, RENAMED_FLAGS.get(name, name): value}}


def load_config(
    extra_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve the config from ``extra_config``, the JSON file and the
    environment (``os.environ`` by default); ``ValueError`` on any invalid value."""
    env = os.environ if environ is None else environ
    merged = _merge([source(extra_config, env) for _name, source in SOURCES])
    config = SiMMConfig(**_validate(merged))
    sources = {name: merged[name][1] if name in merged else "default" for name in FIELD_NAMES}
    return ResolvedConfig(config=config, sources=sources)


def log_resolved(resolved: ResolvedConfig, log: logging.Logger | None = None) -> None:
    """Log the resolved config, one line per field with its source."""
    log = log or logger
    log.info("SiMM config resolved (%d fields):", len(FIELD_NAMES))
    for name, value, source in resolved.describe():
        log.info("  %-24s %r  (%s)", name, value, source)


# Validation: each parser returns the value or raises InvalidValue.


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, with None (unset) let through."""
    return lambda value: None if value is None else parse(value)


def _parse_int(value: Any, lo: int, hi: int | None = None, accepted: str | None = None) -> int:
    accepted = accepted or f"an integer in {lo}..{hi if hi is not None else 'inf'} (a number or a digit string)"
    if isinstance(value, bool):
        raise InvalidValue("is a bool, not an integer", accepted)
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        number = int(value.strip())
    else:
        raise InvalidValue(f"is not an integer ({type(value).__name__})", accepted)
    if number < lo or (hi is not None and number > hi):
        raise InvalidValue("is out of range", accepted)
    return number


def _parse_tag(value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise InvalidValue(
            "is not a valid tag: it goes into every key, and SiMM caps keys at 256 bytes, "
            "so it must be short and plain",
            "1 to 64 characters from A-Z a-z 0-9 . _ -, or null for no tag",
        )
    return value


def _parse_devices(value: Any) -> tuple[str, ...] | None:
    accepted = 'a list of RDMA device names or a comma string like "mlx5_0,mlx5_1"; null picks by NUMA node'
    if isinstance(value, str):
        items: list[Any] = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise InvalidValue(f"is not a device list ({type(value).__name__})", accepted)
    names = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidValue(f"holds a non-string {item!r}", accepted)
        name = item.strip()
        if not name:
            continue
        if not _DEVICE_RE.fullmatch(name):
            raise InvalidValue(f"holds a malformed device name {name!r}", accepted)
        names.append(name)
    return tuple(dict.fromkeys(names)) or None  # de-duplicated, order kept; empty = unset


def _parse_log_file(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue(
            "is not a file path",
            f"a path the process can write, or null for the default under ${LOG_DIR_ENV} or the temp dir",
        )
    return value.strip()


def _parse_store_dir(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue("is not a directory path", "a directory of this user's on a local filesystem (tmpfs: "
                           "memory; a disk: kept across restarts, bigger than RAM), or null for the default")
    return os.path.abspath(os.path.expanduser(value.strip()))


def parse_client_flags(value: Any, *, where: str | None = None, warn: bool = True) -> dict[str, str]:
    """A flag dict (or a JSON object string) -> ``{name: text}``, the local
    store's old flag names (``RENAMED_FLAGS``) read as the new ones, each
    warned about (``warn``) naming the new one; an old and a new name of one
    flag together are refused."""
    flags = _raw_client_flags(value)
    moved = sorted(MOVED_FLAGS & set(flags))
    if moved:
        raise InvalidValue(f"holds {', '.join(moved)}, which the local store no longer reads", MOVED_WHERE)
    for old, new in RENAMED_FLAGS.items():
        if old not in flags:
            continue
        if new in flags:
            raise InvalidValue(f"holds both {old} (deprecated) and {new}, one flag's old and new names",
                               f"only {new}")
        if warn:
            logger.warning("SiMM config: client flag %s%s", deprecated(old, new), f" (in {where})" if where else "")
        flags[new] = flags.pop(old)
    return flags


def _raw_client_flags(value: Any) -> dict[str, str]:
    """A flag dict (or a JSON object string) -> ``{name: text}``, names as given."""
    accepted = 'a JSON object of SiMM client flags, e.g. {"clnt_syncreq_enable_retry": true}'
    data = value
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidValue(f"is not valid JSON ({exc})", accepted) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidValue(f"is not an object ({type(data).__name__})", accepted)
    flags: dict[str, str] = {}
    for name, flag_value in data.items():
        if not isinstance(name, str) or not _FLAG_NAME_RE.fullmatch(name):
            raise InvalidValue(f"has a malformed flag name {name!r}", accepted)
        if isinstance(flag_value, bool):
            flags[name] = "true" if flag_value else "false"
        elif isinstance(flag_value, (int, float, str)):
            flags[name] = str(flag_value)
        else:
            raise InvalidValue(f"has a non-scalar value for {name!r}: {flag_value!r}", accepted)
    return flags


def _parse_fraction(value: Any) -> float:
    """A number in [0, 1) (a JSON number or a numeric string)."""
    accepted = "a number from 0 up to (not including) 1, e.g. 0.2"
    if isinstance(value, bool):
        raise InvalidValue("is a bool, not a number", accepted)
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise InvalidValue("is not a number", accepted) from None
    else:
        raise InvalidValue(f"is not a number ({type(value).__name__})", accepted)
    if not 0.0 <= number < 1.0:  # NaN fails this too
        raise InvalidValue("is out of range", accepted)
    return number


def _parse_key_scheme(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in KEY_SCHEMES:
        return value.strip().lower()
    raise InvalidValue("is not a key scheme", " or ".join(repr(s) for s in KEY_SCHEMES))


_ADDRESS_FORMS = (
    '"host:port" (e.g. "10.0.0.1:30001"), "[ipv6]:port" (e.g. "[fd00::1]:30001"), '
    f'or "local" / "local://NAME" (the local store, shared by every process on this host); NAME: {STORE_NAME_RULE}'
)


def _parse_address(value: Any) -> tuple[str, str, int | None]:
    """``("host" | "process", store name, None)`` for the local store, or
    ``("cluster", host, port)``; raises InvalidValue."""
    if not isinstance(value, str):
        raise InvalidValue(f"is not a string ({type(value).__name__})", _ADDRESS_FORMS)
    text = value.strip()
    scheme, sep, name = text.partition("://")
    if scheme in _LOCAL_STORE_FORMS and (sep or not name):
        if not sep:
            name = _LOCAL_STORE_DEFAULT_NAME
        if not STORE_NAME_RE.match(name):
            raise InvalidValue(f"has a malformed local store name {name!r}", _ADDRESS_FORMS)
        return (_LOCAL_STORE_FORMS[scheme], name, None)
    near = _near_local_form(scheme if sep else text)
    if near is not None:
        meant = f"{near}://{name}" if sep else near
        raise InvalidValue(f"is no address and no local store form (did you mean {meant!r}?)", _ADDRESS_FORMS)
    if "://" in text:
        raise InvalidValue("has a URL scheme; give the bare address", _ADDRESS_FORMS)
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise InvalidValue("opens '[' without closing ']'", _ADDRESS_FORMS)
        host, rest = text[1:close], text[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidValue(f"has {host!r} in brackets, which is not an IPv6 address", _ADDRESS_FORMS) from None
        if not rest.startswith(":") or not rest[1:]:
            raise InvalidValue("has no port after the bracketed IPv6 address", _ADDRESS_FORMS)
        port_text = rest[1:]
    else:
        if text.count(":") > 1:
            raise InvalidValue("looks like an IPv6 address without brackets", _ADDRESS_FORMS)
        host, sep, port_text = text.partition(":")
        if not sep or not port_text:
            raise InvalidValue("has no port (the manager's RPC port is usually 30001)", _ADDRESS_FORMS)
        if not host:
            raise InvalidValue("has an empty host", _ADDRESS_FORMS)
        if not _HOST_RE.fullmatch(host):
            raise InvalidValue(f"has a malformed host {host!r}", _ADDRESS_FORMS)
    if not port_text.isdigit():
        raise InvalidValue(f"has a non-numeric port {port_text!r}", _ADDRESS_FORMS)
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise InvalidValue(f"has port {port} out of range 1..65535", _ADDRESS_FORMS)
    return ("cluster", host, port)


def _near_local_form(word: str) -> str | None:
    """The local store form ``word`` misspells (``locl``, ``Local``,
    ``inproces``), or None; a host name with a port never is one."""
    if ":" in word or word in _LOCAL_STORE_FORMS:
        return None
    close = difflib.get_close_matches(word.lower(), _LOCAL_STORE_FORMS, n=1, cutoff=0.8)
    return close[0] if close else None


_warned_inprocess: set[str] = set()


def _parse_manager_address(value: Any) -> str:
    kind, name_or_host, port = _parse_address(value)
    if kind != "cluster":
        form = next(f for f, scope in _LOCAL_STORE_FORMS.items() if scope == kind)
        if form == "inprocess" and form not in _warned_inprocess:
            _warned_inprocess.add(form)
            logger.warning("SiMM config: %s", deprecated('manager_address "inprocess"', '"local" (with '
                           "local_store_dir for a store of this process's own)"))
        return form if name_or_host == _LOCAL_STORE_DEFAULT_NAME else f"{form}://{name_or_host}"
    host = f"[{name_or_host}]" if ":" in name_or_host else name_or_host
    return f"{host}:{port}"


#: One parser per field. Every field must have one (checked at import).
_PARSERS: dict[str, Callable[[Any], Any]] = {
    "manager_address": _parse_manager_address,
    "clnt_threadpool_size": lambda v: _parse_int(v, 1, 1024),
    "enable_profile": parse_bool,
    "extra_backend_tag": _optional(_parse_tag),
    "rdma_devices": _optional(_parse_devices),
    "numa_aware": parse_bool,
    "numa_node": _optional(lambda v: _parse_int(v, 0, accepted="a NUMA node id >= 0, or null to work it out")),
    "request_timeout_ms": lambda v: _parse_int(v, 1, 3_600_000),
    "log_file": _optional(_parse_log_file),
    "client_flags": lambda v: FlagMap(parse_client_flags(v)),
    "local_store_capacity_bytes": _optional(parse_byte_size),
    "local_store_dir": _optional(_parse_store_dir),
    "key_scheme": _parse_key_scheme,
    "warmup": parse_bool,
    "breaker_enabled": parse_bool,
    "breaker_threshold": lambda v: _parse_int(v, 1, 1000),
    "breaker_backoff_ms": lambda v: _parse_int(v, 1, 3_600_000),
    "breaker_backoff_max_ms": lambda v: _parse_int(v, 1, 3_600_000),
    "breaker_jitter": _parse_fraction,
    "kv_events": parse_kv_events,
}
assert set(_PARSERS) == set(FIELD_NAMES), "every SiMMConfig field needs a parser"

_MISSING_ADDRESS = (
    "SiMM config: manager_address is not set. Set it in one of three ways: "
    '(1) the extra_config key "manager_address", e.g. '
    '--hicache-storage-backend-extra-config \'{"manager_address": "10.0.0.1:30001"}\'; '
    f'(2) a JSON file {{"manager_address": ...}} named by the env var {CONFIG_PATH_ENV}; '
    f"(3) the env var {MANAGER_ENV} (or {env_var_name('manager_address')}). "
    'Use "local" (or "local://NAME") to run on the local store (no cluster needed).'
)


def _problem(name: str, value: Any, source: str, exc: InvalidValue) -> str:
    """The one wording of a refused value: field, value, source, what is accepted."""
    return f"SiMM config: {name}={value!r} (from {source}) {exc.problem}; accepted: {exc.accepted}"


def _validate(raw: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """The one validation: ``{field: (value, source)}`` -> normalised field
    values, defaults for the absent; every problem in one ``ValueError``."""
    errors: list[str] = []
    out: dict[str, Any] = {}
    for name in FIELD_NAMES:
        value, source = raw.get(name, (None, "default"))
        if name == "manager_address" and (value is None or (isinstance(value, str) and not value.strip())):
            errors.append(_MISSING_ADDRESS)
            continue
        if name not in raw:
            out[name] = _DEFAULTS[name]
            continue
        if isinstance(value, FlagMap):
            out[name] = value  # client_flags, already parsed while merging (with its source)
            continue
        try:
            out[name] = _PARSERS[name](value)
        except InvalidValue as exc:
            errors.append(_problem(name, value, source, exc))
    errors += _cross_field_problems(out, raw)
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} problems in the SiMM config:\n- " + "\n- ".join(errors))
    return out


def _cross_field_problems(out: Mapping[str, Any], raw: Mapping[str, tuple[Any, str]]) -> list[str]:
    """Rules between fields, checked once each field is valid on its own."""
    problems = []
    base, cap = out.get("breaker_backoff_ms"), out.get("breaker_backoff_max_ms")
    if base is not None and cap is not None and cap < base:
        where = lambda name: raw.get(name, (None, "default"))[1]  # noqa: E731
        problems.append(
            f"SiMM config: breaker_backoff_max_ms={cap!r} (from {where('breaker_backoff_max_ms')}) is "
            f"below breaker_backoff_ms={base!r} (from {where('breaker_backoff_ms')}); accepted: a cap "
            "at least the first wait: raise breaker_backoff_max_ms or lower breaker_backoff_ms"
        )
    return problems


def local_store_place(config: SiMMConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The directory a ``local`` address's store lives in, as this process's
    client finds it, and what chose it (``client flag local_store_dir``,
    ``local_store_dir``, ``env SGLANG_SIMM_STORE_DIR`` or ``default``); None
    for a cluster or the in-process store."""
    if config.local_store_scope != "host":
        return None
    env = os.environ if environ is None else environ
    flag, field = config.client_flags.get("local_store_dir") or "", config.local_store_dir or ""
    variable = env.get(STORE_DIR_ENV) or ""
    why = ("client flag local_store_dir" if flag else "local_store_dir" if field else
           f"env {STORE_DIR_ENV}" if variable else "default")
    return store_dir(flag or field or variable or None), why


_LOG_STAMP: dict[int, str] = {}


def default_log_file(environ: Mapping[str, str] | None = None) -> str:
    """This process's default SiMM client log path, ``$SGLANG_SIMM_LOG_DIR`` (or
    ``<tempdir>/sglang-simm``) ``/<YYYYmmdd-HHMMSS>-<pid>/simm_clnt.log``, never
    under ``/var/log``; fixed per process. The caller makes the directory."""
    env = os.environ if environ is None else environ
    pid = os.getpid()
    stamp = _LOG_STAMP.setdefault(pid, time.strftime("%Y%m%d-%H%M%S"))
    base = env.get(LOG_DIR_ENV, "").strip() or os.path.join(tempfile.gettempdir(), "sglang-simm")
    return os.path.join(base, f"{stamp}-{pid}", "simm_clnt.log")
