"""SiMMConfig: sources and their precedence, parsing, and every validation error."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest

from sglang_simm.config import (
    CONFIG_PATH_ENV,
    LOG_DIR_ENV,
    MANAGER_ENV,
    SGLANG_EXTRA_CONFIG_KEYS,
    SOURCES,
    ResolvedConfig,
    SiMMConfig,
    client_flag,
    default_log_file,
    find_unknown_keys,
    load_config,
    log_resolved,
    parse_byte_size,
    with_client_flag,
)

ADDR = "10.0.0.1:30001"
GIB = 1024**3


@pytest.fixture
def write_file(tmp_path):
    """Write a JSON config file; returns an environ naming it."""

    def write(data, name="simm.json"):
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        return {CONFIG_PATH_ENV: str(path)}, str(path)

    return write


def error_of(extra=None, environ=None) -> str:
    with pytest.raises(ValueError) as info:
        load_config(extra, environ or {})
    return str(info.value)


# --------------------------------------------------------------------------
# Sources and precedence
# --------------------------------------------------------------------------


def test_sources_written_once_in_priority_order():
    assert [name for name, _fn in SOURCES] == ["extra_config", "file", "env"]


def test_defaults_with_address_only():
    resolved = load_config({"manager_address": ADDR}, {})
    cfg = resolved.config
    assert (cfg.clnt_threadpool_size, cfg.enable_profile, cfg.extra_backend_tag) == (10, False, None)
    assert (cfg.rdma_devices, cfg.numa_aware, cfg.numa_node) == (None, True, None)
    assert (cfg.request_timeout_ms, cfg.log_file, dict(cfg.client_flags)) == (1000, None, {})
    assert (cfg.local_store_capacity_bytes, cfg.key_scheme, cfg.warmup) == (None, "namespaced", True)
    assert resolved.sources["manager_address"] == "extra_config"
    assert {s for f, s in resolved.sources.items() if f != "manager_address"} == {"default"}


def test_precedence_per_field_extra_over_file_over_env(write_file):
    environ, path = write_file({"manager_address": "file-host:2", "clnt_threadpool_size": 20, "numa_node": 1})
    environ.update(
        {
            MANAGER_ENV: "env-host:3",
            "SGLANG_SIMM_CLNT_THREADPOOL_SIZE": "30",
            "SGLANG_SIMM_KEY_SCHEME": "legacy",
            "SGLANG_SIMM_NUMA_NODE": "3",
        }
    )
    resolved = load_config({"manager_address": "extra-host:1"}, environ)
    cfg = resolved.config
    assert cfg.manager_address == "extra-host:1"
    assert cfg.clnt_threadpool_size == 20
    assert cfg.numa_node == 1
    assert cfg.key_scheme == "legacy"
    assert resolved.sources["manager_address"] == "extra_config"
    assert resolved.sources["clnt_threadpool_size"] == f"file:{path}"
    assert resolved.sources["key_scheme"] == "env:SGLANG_SIMM_KEY_SCHEME"
    assert resolved.sources["warmup"] == "default"


def test_file_alone(write_file):
    environ, path = write_file({"manager_address": ADDR, "enable_profile": True})
    resolved = load_config(None, environ)
    assert resolved.config.manager_address == ADDR and resolved.config.enable_profile is True
    assert resolved.sources["manager_address"] == f"file:{path}"


def test_simm_cluster_manager_env():
    resolved = load_config(None, {MANAGER_ENV: ADDR})
    assert resolved.config.manager_address == ADDR
    assert resolved.sources["manager_address"] == f"env:{MANAGER_ENV}"


def test_generic_address_env_wins_over_simm_cluster_manager():
    resolved = load_config(None, {MANAGER_ENV: "a:1", "SGLANG_SIMM_MANAGER_ADDRESS": "b:2"})
    assert resolved.config.manager_address == "b:2"
    assert resolved.sources["manager_address"] == "env:SGLANG_SIMM_MANAGER_ADDRESS"


def test_empty_env_value_counts_as_unset():
    resolved = load_config(None, {MANAGER_ENV: ADDR, "SGLANG_SIMM_NUMA_NODE": "", "SGLANG_SIMM_WARMUP": " "})
    assert resolved.config.numa_node is None and resolved.config.warmup is True
    assert resolved.sources["numa_node"] == "default"


ENV_CASES = [
    ("clnt_threadpool_size", "16", 16),
    ("enable_profile", "yes", True),
    ("extra_backend_tag", "blue-1", "blue-1"),
    ("rdma_devices", "mlx5_0, mlx5_1", ("mlx5_0", "mlx5_1")),
    ("numa_aware", "off", False),
    ("numa_node", "1", 1),
    ("request_timeout_ms", "2500", 2500),
    ("log_file", "/tmp/x/simm.log", "/tmp/x/simm.log"),
    ("client_flags", '{"clnt_use_k8s": false}', {"clnt_use_k8s": "false"}),
    ("local_store_capacity_bytes", "512MiB", 512 * 1024**2),
    ("key_scheme", "LEGACY", "legacy"),
    ("warmup", "0", False),
    ("breaker_enabled", "off", False),
    ("breaker_threshold", "3", 3),
    ("breaker_backoff_ms", "250", 250),
    ("breaker_backoff_max_ms", "60000", 60000),
    ("breaker_jitter", "0.5", 0.5),
]


@pytest.mark.parametrize(("field", "text", "expected"), ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_every_field_has_an_env_var(field, text, expected):
    var = f"SGLANG_SIMM_{field.upper()}"
    resolved = load_config(None, {MANAGER_ENV: ADDR, var: text})
    value = getattr(resolved.config, field)
    assert (dict(value) if field == "client_flags" else value) == expected
    assert resolved.sources[field] == f"env:{var}"


def test_client_flags_merge_per_flag(write_file):
    environ, path = write_file({"client_flags": {"a": "file", "b": "file"}})
    environ["SGLANG_SIMM_CLIENT_FLAGS"] = json.dumps({"b": "env", "c": 3, "d": True})
    resolved = load_config({"manager_address": ADDR, "client_flags": {"a": "extra"}}, environ)
    assert dict(resolved.config.client_flags) == {"a": "extra", "b": "file", "c": "3", "d": "true"}
    assert resolved.sources["client_flags"] == f"extra_config, file:{path}, env:SGLANG_SIMM_CLIENT_FLAGS"


def test_one_client_flag_as_the_highest_source_sets_it(write_file):
    environ, _path = write_file({"client_flags": {"a": "file", "b": "file"}})
    environ["SGLANG_SIMM_CLIENT_FLAGS"] = json.dumps({"b": "env", "c": "env"})
    extra = {"client_flags": json.dumps({"a": "extra"})}
    assert [client_flag(extra, f, environ) for f in "abcd"] == ["extra", "file", "env", None]
    # a broken source is load_config's to report, not this lookup's
    assert client_flag({"client_flags": "[1]"}, "a", environ) is None


def test_a_client_flag_set_in_the_extra_config_keeps_the_others():
    extra = {"manager_address": ADDR, "client_flags": json.dumps({"a": 1, "local_store_dir": "/old"})}
    out = with_client_flag(extra, "local_store_dir", "/new")
    assert out["client_flags"] == {"a": "1", "local_store_dir": "/new"} and out["manager_address"] == ADDR
    assert dict(load_config(out, {}).config.client_flags) == {"a": "1", "local_store_dir": "/new"}
    assert json.loads(extra["client_flags"])["local_store_dir"] == "/old"  # the caller's is left alone


def test_caller_dict_not_mutated():
    extra = {"manager_address": ADDR, "backend_name": "simm", "client_flags": {"x": 1}}
    before = json.dumps(extra, sort_keys=True)
    load_config(extra, {})
    assert json.dumps(extra, sort_keys=True) == before


# --------------------------------------------------------------------------
# The JSON file's own errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "fragment"),
    [("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object"), ('"text"', "must hold a JSON object")],
    ids=["invalid-json", "array", "string"],
)
def test_bad_file_names_path_and_env_var(write_file, content, fragment):
    environ, path = write_file(content)
    message = error_of({"manager_address": ADDR}, environ)
    assert fragment in message and path in message and CONFIG_PATH_ENV in message


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    message = error_of(None, {CONFIG_PATH_ENV: path})
    assert "cannot be read" in message and path in message and CONFIG_PATH_ENV in message


def test_unreadable_file_a_directory(tmp_path):
    message = error_of(None, {CONFIG_PATH_ENV: str(tmp_path)})
    assert "cannot be read" in message and str(tmp_path) in message


def test_extra_config_not_a_mapping():
    with pytest.raises(ValueError, match="extra_config must be a JSON object"):
        load_config(["manager_address"], {})  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Validation: field, value, what is accepted, and where it came from
# --------------------------------------------------------------------------


def test_missing_address_says_all_three_ways():
    message = error_of({}, {})
    assert "manager_address is not set" in message
    assert '"manager_address"' in message  # the extra_config key
    assert CONFIG_PATH_ENV in message
    assert MANAGER_ENV in message
    assert '"local"' in message and "local store" in message


BAD_VALUES = [
    ("manager_address", "10.0.0.1", "has no port"),
    ("manager_address", ":30001", "empty host"),
    ("manager_address", "host:http", "non-numeric port"),
    ("manager_address", "fd00::1:30001", "IPv6 address without brackets"),
    ("manager_address", "[fd00::1]", "no port after the bracketed"),
    ("manager_address", "[fd00::1:30001", "without closing"),
    ("manager_address", "[not-ipv6]:1", "not an IPv6 address"),
    ("manager_address", "host:0", "out of range 1..65535"),
    ("manager_address", "host:65536", "out of range 1..65535"),
    ("manager_address", "tcp://host:1", "URL scheme"),
    ("manager_address", "bad host:1", "malformed host"),
    ("manager_address", 30001, "not a string"),
    ("manager_address", "local://", "malformed local store name"),
    ("manager_address", "local://a/b", "malformed local store name"),
    ("manager_address", "local://" + "x" * 65, "malformed local store name"),
    ("manager_address", "locl", "did you mean 'local'?"),
    ("manager_address", "Local", "did you mean 'local'?"),
    ("manager_address", "locl://cache", "did you mean 'local://cache'?"),
    ("manager_address", "inproces", "did you mean 'inprocess'?"),
    ("clnt_threadpool_size", 0, "out of range"),
    ("clnt_threadpool_size", 1025, "out of range"),
    ("clnt_threadpool_size", "ten", "not an integer"),
    ("clnt_threadpool_size", 1.5, "not an integer"),
    ("clnt_threadpool_size", True, "is a bool"),
    ("request_timeout_ms", 0, "out of range"),
    ("enable_profile", "maybe", "not a boolean"),
    ("enable_profile", 2, "not a boolean"),
    ("numa_aware", None, "not a boolean"),
    ("extra_backend_tag", "has space", "256 bytes"),
    ("extra_backend_tag", "x" * 65, "256 bytes"),
    ("extra_backend_tag", 7, "256 bytes"),
    ("rdma_devices", 5, "not a device list"),
    ("rdma_devices", ["mlx5_0", 1], "non-string"),
    ("rdma_devices", "mlx5 0", "malformed device name"),
    ("numa_node", -1, "out of range"),
    ("numa_node", "one", "not an integer"),
    ("log_file", "", "not a file path"),
    ("log_file", 3, "not a file path"),
    ("client_flags", "{oops", "not valid JSON"),
    ("client_flags", [1], "not an object"),
    ("client_flags", {"bad-name": 1}, "malformed flag name"),
    ("client_flags", {"x": [1]}, "non-scalar value"),
    ("local_store_capacity_bytes", 0, "not positive"),
    ("local_store_capacity_bytes", "-1GiB", "not a byte size"),
    ("local_store_capacity_bytes", "12XB", "not a byte size"),
    ("local_store_capacity_bytes", 1.5, "not a byte size"),
    ("key_scheme", "flat", "'namespaced' or 'legacy'"),
    ("warmup", "2", "not a boolean"),
    ("breaker_enabled", "sometimes", "not a boolean"),
    ("breaker_threshold", 0, "out of range"),
    ("breaker_threshold", 1001, "out of range"),
    ("breaker_threshold", "five", "not an integer"),
    ("breaker_threshold", True, "is a bool"),
    ("breaker_backoff_ms", 0, "out of range"),
    ("breaker_backoff_ms", 1.5, "not an integer"),
    ("breaker_backoff_max_ms", 3_600_001, "out of range"),
    ("breaker_jitter", 1, "out of range"),
    ("breaker_jitter", -0.1, "out of range"),
    ("breaker_jitter", float("nan"), "out of range"),
    ("breaker_jitter", "20%", "not a number"),
    ("breaker_jitter", True, "is a bool"),
    ("breaker_jitter", [0.2], "not a number"),
]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    BAD_VALUES,
    ids=[f"{f}={v!r}"[:48] for f, v, _ in BAD_VALUES],
)
def test_invalid_value_names_field_value_fix_and_source(field, value, fragment):
    extra = {"manager_address": ADDR, field: value}
    message = error_of(extra, {})
    assert fragment in message
    if field == "client_flags":
        assert "client_flags=" in message
    else:
        assert f"{field}={value!r}" in message
    assert "accepted:" in message
    assert "(from extra_config)" in message


def test_breaker_defaults_are_the_documented_ones():
    cfg = load_config({"manager_address": ADDR}, {}).config
    assert (cfg.breaker_enabled, cfg.breaker_threshold, cfg.breaker_jitter) == (True, 5, 0.2)
    assert (cfg.breaker_backoff_ms, cfg.breaker_backoff_max_ms) == (1000, 30000)


def test_breaker_cap_below_base_names_both_fields_and_the_fix(write_file):
    environ, path = write_file({"breaker_backoff_max_ms": 500})
    message = error_of({"manager_address": ADDR, "breaker_backoff_ms": 2000}, environ)
    assert f"breaker_backoff_max_ms=500 (from file:{path})" in message
    assert "breaker_backoff_ms=2000 (from extra_config)" in message
    assert "raise breaker_backoff_max_ms or lower breaker_backoff_ms" in message


def test_breaker_cap_below_the_default_base():
    message = error_of({"manager_address": ADDR, "breaker_backoff_max_ms": 999}, {})
    assert "breaker_backoff_max_ms=999" in message and "breaker_backoff_ms=1000 (from default)" in message


def test_breaker_cap_equal_to_base_and_jitter_zero_accepted():
    cfg = SiMMConfig(manager_address=ADDR, breaker_backoff_ms=5000, breaker_backoff_max_ms=5000, breaker_jitter=0)
    assert (cfg.breaker_backoff_max_ms, cfg.breaker_jitter) == (5000, 0.0)
    with pytest.raises(ValueError, match="breaker_backoff_max_ms=10"):
        SiMMConfig(manager_address=ADDR, breaker_backoff_max_ms=10)


def test_env_error_names_the_env_var():
    message = error_of(None, {MANAGER_ENV: ADDR, "SGLANG_SIMM_CLNT_THREADPOOL_SIZE": "0"})
    assert "clnt_threadpool_size='0'" in message and "env:SGLANG_SIMM_CLNT_THREADPOOL_SIZE" in message


def test_env_client_flags_error_names_the_env_var():
    message = error_of(None, {MANAGER_ENV: ADDR, "SGLANG_SIMM_CLIENT_FLAGS": "[]"})
    assert "client_flags='[]'" in message and "env:SGLANG_SIMM_CLIENT_FLAGS" in message


def test_file_error_names_the_file(write_file):
    environ, path = write_file({"manager_address": ADDR, "key_scheme": "flat"})
    message = error_of(None, environ)
    assert "key_scheme='flat'" in message and f"file:{path}" in message


def test_all_problems_reported_at_once():
    message = error_of({"manager_address": "nohost", "numa_node": -2, "warmup": "sometimes"}, {})
    assert message.startswith("3 problems")
    for part in ("manager_address='nohost'", "numa_node=-2", "warmup='sometimes'"):
        assert part in message


# --------------------------------------------------------------------------
# Unknown keys: a warning with a suggestion; SGLang's keys: silence
# --------------------------------------------------------------------------


def test_unknown_key_warns_with_suggestion(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        load_config({"manager_address": ADDR, "clnt_thread_pool_size": 4}, {})
    [record] = caplog.records
    text = record.getMessage()
    assert "'clnt_thread_pool_size'" in text and "did you mean 'clnt_threadpool_size'" in text
    assert "extra_config" in text


def test_unknown_key_in_file_warns_naming_file(caplog, write_file):
    environ, path = write_file({"manager_adress": ADDR, "zzz": 1})
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        load_config({"manager_address": ADDR}, environ)
    texts = [r.getMessage() for r in caplog.records]
    assert any("did you mean 'manager_address'" in t and path in t for t in texts)
    assert any("'zzz'" in t and "did you mean" not in t for t in texts)


def test_a_misspelt_environment_variable_warns_with_the_right_name(caplog):
    environ = {"SGLANG_SIMM_REQUEST_TIMOUT_MS": "50", "SGLANG_SIMM_STORE_DIR": "/tmp/x",
               "SGLANG_SIMM_TEST_WORKERS": "2", "SGLANG_SIMM_WARMUP": "0"}
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        resolved = load_config({"manager_address": ADDR}, environ)
    [record] = caplog.records  # the store's and the tools' own variables are not fields' near misses
    text = record.getMessage()
    assert "SGLANG_SIMM_REQUEST_TIMOUT_MS" in text and "did you mean SGLANG_SIMM_REQUEST_TIMEOUT_MS?" in text
    assert resolved.config.request_timeout_ms == 1000 and resolved.config.warmup is False
    assert [u.key for u in find_unknown_keys({}, environ)] == ["SGLANG_SIMM_REQUEST_TIMOUT_MS"]


@pytest.mark.parametrize(("variable", "meant"), [
    ("SIMM_CLUSTER_MANGER", MANAGER_ENV),
    ("SGLANG_HICACHE_SIMM_CONFIG", CONFIG_PATH_ENV),
    ("sglang_hicache_simm_config_path", CONFIG_PATH_ENV),
    ("sglang_simm_warmup", "SGLANG_SIMM_WARMUP"),
    ("SGLANG_SIMM_STORE_DRI", "SGLANG_SIMM_STORE_DIR"),
    ("SGLANG_SIMM_LOG_DRI", LOG_DIR_ENV),
], ids=lambda v: v)
def test_a_variable_of_ours_misspelt_or_in_another_case_is_named_and_the_start_goes_on(caplog, variable, meant):
    """The backend warns, naming the variable meant, and starts: it never
    refuses a start over a name (doctor makes it a problem)."""
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        resolved = load_config({"manager_address": ADDR}, {variable: "1"})
    assert resolved.config.manager_address == ADDR
    [record] = caplog.records
    assert record.getMessage() == (f"SiMM config: unknown variable {variable} in the environment is ignored; "
                                   f"did you mean {meant}?")


def test_every_variable_the_project_names_is_known_or_no_near_miss():
    """The store's, the tools' and the tests' own variables are never
    reported as a field's misspelling (names read from the sources)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    name = re.compile(r"\b(?:[A-Z0-9]+_)*SIMM(?:_[A-Z0-9]+)+\b")
    paths = [root / "README.md", *(p for folder in ("src", "dev", "scripts", "docs", "examples")
                                   for p in (root / folder).rglob("*") if p.suffix in (".py", ".sh", ".md"))]
    named = {found for path in paths for found in name.findall(path.read_text(errors="replace"))}
    # unknown_env_vars's own examples of misspellings
    named -= {"SGLANG_SIMM_REQUEST_TIMOUT_MS", "SIMM_CLUSTER_MANGER", "SGLANG_HICACHE_SIMM_CONFIG"}
    assert {"SGLANG_SIMM_STORE_METRICS_HOST", "SGLANG_SIMM_TEST_WORKERS", MANAGER_ENV} <= named
    assert find_unknown_keys({}, dict.fromkeys(named, "1")) == []


def test_sglang_keys_accepted_silently(caplog):
    extra = {"manager_address": ADDR, **{key: 1 for key in SGLANG_EXTRA_CONFIG_KEYS}}
    extra.update(backend_name="simm", module_path="sglang_simm", class_name="HiCacheSiMM", interface_v1=1)
    with caplog.at_level(logging.DEBUG, logger="sglang_simm.config"):
        resolved = load_config(extra, {})
    assert caplog.records == []
    assert resolved.config.manager_address == ADDR


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [(True, True), (False, False)]
    + [(t, True) for t in ("true", "TRUE", "1", "yes", "On")]
    + [(t, False) for t in ("false", "False", "0", "no", "OFF")],
    ids=lambda v: repr(v),
)
def test_bool_spellings(text, expected):
    assert load_config({"manager_address": ADDR, "enable_profile": text}, {}).config.enable_profile is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 1024**2),
        ("4GiB", 4 * GIB),
        ("1.5G", int(1.5 * GIB)),
        ("64k", 64 * 1024),
        ("8GB", 8 * 10**9),
        (" 2 TiB ", 2 * 1024**4),
        ("100b", 100),
    ],
    ids=lambda v: repr(v),
)
def test_byte_sizes(value, expected):
    assert parse_byte_size(value) == expected
    cfg = load_config({"manager_address": "local", "local_store_capacity_bytes": value}, {}).config
    assert cfg.local_store_capacity_bytes == expected


def test_byte_size_error_text():
    with pytest.raises(ValueError, match=r"byte size '1 parsec'.*512MiB"):
        parse_byte_size("1 parsec")


def test_rdma_devices_forms():
    for value in (["mlx5_0", "mlx5_1", "mlx5_0"], "mlx5_0,mlx5_1,", ("mlx5_0", " mlx5_1")):
        assert load_config({"manager_address": ADDR, "rdma_devices": value}, {}).config.rdma_devices == (
            "mlx5_0",
            "mlx5_1",
        )
    assert load_config({"manager_address": ADDR, "rdma_devices": ""}, {}).config.rdma_devices is None
    assert load_config({"manager_address": ADDR, "rdma_devices": []}, {}).config.rdma_devices is None


ADDRESSES = [
    ("10.0.0.1:30001", "10.0.0.1:30001", False, None, "10.0.0.1", 30001),
    (" simm-cm.svc:1 ", "simm-cm.svc:1", False, None, "simm-cm.svc", 1),
    ("[fd00::1]:30001", "[fd00::1]:30001", False, None, "fd00::1", 30001),
    ("[::1]:65535", "[::1]:65535", False, None, "::1", 65535),
    ("local", "local", True, "default", None, None),
    ("local://cache.A-1_b", "local://cache.A-1_b", True, "cache.A-1_b", None, None),
]


@pytest.mark.parametrize(
    ("given", "normal", "local", "name", "host", "port"), ADDRESSES, ids=[a[0].strip() for a in ADDRESSES]
)
def test_address_forms(given, normal, local, name, host, port):
    cfg = load_config({"manager_address": given}, {}).config
    assert cfg.manager_address == normal
    assert (cfg.is_local_store, cfg.local_store_name, cfg.host, cfg.port) == (local, name, host, port)


# --------------------------------------------------------------------------
# The dataclass itself
# --------------------------------------------------------------------------


def test_from_mapping_and_direct_construction_validate():
    cfg = SiMMConfig.from_mapping({"manager_address": ADDR, "numa_node": "2", "interface_v1": True})
    assert cfg.numa_node == 2
    with pytest.raises(ValueError, match=r"numa_node=-1 \(from mapping\)"):
        SiMMConfig.from_mapping({"manager_address": ADDR, "numa_node": -1})
    with pytest.raises(ValueError, match=r"key_scheme='x' \(from SiMMConfig\(\)\)"):
        SiMMConfig(manager_address=ADDR, key_scheme="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="manager_address is not set"):
        SiMMConfig.from_mapping({})


def test_frozen_and_hashable():
    cfg = SiMMConfig(manager_address=ADDR, client_flags={"a": 1}, rdma_devices=["mlx5_0"])  # type: ignore[arg-type]
    assert cfg.rdma_devices == ("mlx5_0",) and dict(cfg.client_flags) == {"a": "1"}
    assert hash(cfg) == hash(SiMMConfig(manager_address=ADDR, client_flags={"a": "1"}, rdma_devices=("mlx5_0",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.warmup = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.client_flags["b"] = "2"  # type: ignore[index]


def test_every_field_has_an_attribute_docstring():
    import ast
    import inspect

    import sglang_simm.config as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SiMMConfig")
    documented = set()
    for before, after in zip(cls.body, cls.body[1:]):
        if isinstance(before, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            documented.add(before.target.id)  # type: ignore[union-attr]
    assert documented == {f.name for f in dataclasses.fields(SiMMConfig)}


def test_describe_and_log_resolved(caplog):
    resolved = load_config({"manager_address": ADDR, "client_flags": {"a": 1}}, {"SGLANG_SIMM_WARMUP": "no"})
    assert isinstance(resolved, ResolvedConfig)
    rows = resolved.describe()
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(SiMMConfig)]
    table = {name: (value, source) for name, value, source in rows}
    assert table["warmup"] == (False, "env:SGLANG_SIMM_WARMUP")
    assert table["client_flags"] == ({"a": "1"}, "extra_config")
    assert table["log_file"][0].endswith("simm_clnt.log") and table["log_file"][1] == "default"
    with caplog.at_level(logging.INFO, logger="sglang_simm.config"):
        log_resolved(resolved, logging.getLogger("sglang_simm.config"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + len(rows)
    assert any("warmup" in line and "env:SGLANG_SIMM_WARMUP" in line for line in lines)


# --------------------------------------------------------------------------
# The client's log file
# --------------------------------------------------------------------------


def test_default_log_file_under_tempdir(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = default_log_file({})
    assert not path.startswith("/var/log")
    assert path.startswith(os.path.join(str(tmp_path), "sglang-simm") + os.sep)
    assert path.endswith(f"-{os.getpid()}{os.sep}simm_clnt.log")
    stamp = os.path.basename(os.path.dirname(path)).rsplit("-", 1)[0]
    assert len(stamp) == 15 and stamp[8] == "-" and stamp.replace("-", "").isdigit()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fout:
        fout.write("ok")
    assert default_log_file({}) == path  # stable within a process


def test_default_log_file_honours_log_dir(tmp_path):
    path = default_log_file({LOG_DIR_ENV: str(tmp_path / "logs")})
    assert path.startswith(str(tmp_path / "logs") + os.sep)
    os.makedirs(os.path.dirname(path))
    open(path, "w").close()


def test_explicit_log_file_kept():
    cfg = load_config({"manager_address": ADDR, "log_file": "/data/simm.log"}, {}).config
    assert cfg.log_file == cfg.effective_log_file == "/data/simm.log"


def test_import_is_cheap():
    code = "import sys, sglang_simm.config, sglang_simm.numa; assert 'torch' not in sys.modules and 'sglang' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize(("flags", "environ", "why"), [
    ({"local_store_dir": "/a"}, {"SGLANG_SIMM_STORE_DIR": "/b"}, "client flag local_store_dir"),
    ({}, {"SGLANG_SIMM_STORE_DIR": "/b"}, "env SGLANG_SIMM_STORE_DIR"),
], ids=["flag-over-env", "env"])
def test_a_local_stores_directory_and_what_chose_it(flags, environ, why):
    from sglang_simm.config import local_store_place

    config = SiMMConfig(manager_address="local://x", client_flags=flags)
    assert local_store_place(config, environ) == (flags.get("local_store_dir") or environ["SGLANG_SIMM_STORE_DIR"], why)
    assert local_store_place(SiMMConfig(manager_address=ADDR), environ) is None
    assert local_store_place(SiMMConfig(manager_address="inprocess"), environ) is None
