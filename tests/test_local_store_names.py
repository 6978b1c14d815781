"""One name for the local store: ``local_store_capacity_bytes`` and the
``local_store_*`` client flags. The old ``embedded_*`` names still work for a
release, each with a warning naming the new one; an old and a new name of one
setting given together is refused, naming both."""

from __future__ import annotations

import json
import logging

import pytest

from sglang_simm.config import (
    CONFIG_PATH_ENV,
    RENAMED_FIELDS,
    RENAMED_FLAGS,
    SiMMConfig,
    client_flag,
    find_deprecated_names,
    find_unknown_keys,
    load_config,
    with_client_flag,
    with_current_names,
)

OLD, NEW = "embedded_capacity_bytes", "local_store_capacity_bytes"
OLD_VAR, NEW_VAR = "SGLANG_SIMM_EMBEDDED_CAPACITY_BYTES", "SGLANG_SIMM_LOCAL_STORE_CAPACITY_BYTES"


def warnings_of(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


def test_every_old_name_has_a_new_local_store_name():
    assert RENAMED_FIELDS == {OLD: NEW}
    assert all(old.startswith("embedded_") and new.startswith("local_store_") for old, new in RENAMED_FLAGS.items())
    from sglang_simm.local_store._flags import FLAGS

    assert set(RENAMED_FLAGS.values()) <= set(FLAGS)
    assert not set(RENAMED_FLAGS) & set(FLAGS)


# -- the config field ------------------------------------------------------------


def test_the_old_field_in_the_extra_config_still_works_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        resolved = load_config({"manager_address": "local", OLD: "512MiB"}, {})
    assert resolved.config.local_store_capacity_bytes == 512 << 20
    assert resolved.sources[NEW] == "extra_config"
    [text] = warnings_of(caplog, "sglang_simm.config")
    assert f"{OLD} is deprecated: use {NEW}" in text and "next minor release" in text
    assert "unknown" not in text


def test_the_old_field_in_the_file_still_works_and_warns(caplog, tmp_path):
    path = tmp_path / "simm.json"
    path.write_text(json.dumps({"manager_address": "local", OLD: 1 << 20}))
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        config = load_config(None, {CONFIG_PATH_ENV: str(path)}).config
    assert config.local_store_capacity_bytes == 1 << 20
    [text] = warnings_of(caplog, "sglang_simm.config")
    assert f"{OLD} is deprecated: use {NEW}" in text and str(path) in text


def test_the_old_environment_variable_still_works_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        resolved = load_config({"manager_address": "local"}, {OLD_VAR: "2GiB"})
    assert resolved.config.local_store_capacity_bytes == 2 << 30
    assert resolved.sources[NEW] == f"env:{OLD_VAR}"
    [text] = warnings_of(caplog, "sglang_simm.config")
    assert f"{OLD_VAR} is deprecated: use {NEW_VAR}" in text


def test_the_new_field_wins_over_the_old_one_of_a_lower_source(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        config = load_config({"manager_address": "local", NEW: "1MiB"}, {OLD_VAR: "2GiB"}).config
    assert config.local_store_capacity_bytes == 1 << 20


@pytest.mark.parametrize(
    "extra, environ",
    [
        ({"manager_address": "local", OLD: "1GiB", NEW: "2GiB"}, {}),
        ({"manager_address": "local"}, {OLD_VAR: "1GiB", NEW_VAR: "2GiB"}),
    ],
    ids=["extra_config", "environment"],
)
def test_both_old_and_new_field_are_refused_naming_both(extra, environ):
    with pytest.raises(ValueError) as info:
        load_config(extra, environ)
    message = str(info.value)
    old, new = (OLD, NEW) if not environ else (OLD_VAR, NEW_VAR)
    assert old in message and new in message and "deprecated" in message


def test_both_old_and_new_in_the_file_are_refused_naming_both(tmp_path):
    path = tmp_path / "simm.json"
    path.write_text(json.dumps({"manager_address": "local", OLD: 1, NEW: 2}))
    with pytest.raises(ValueError, match=f"both {OLD} .*and {NEW}"):
        load_config(None, {CONFIG_PATH_ENV: str(path)})


def test_the_old_field_is_not_unknown_and_a_near_miss_suggests_the_new_one():
    environ = {OLD_VAR: "1GiB"}
    assert find_unknown_keys({"manager_address": "local", OLD: 1}, environ) == []
    [miss] = find_unknown_keys({"embeded_capacity_bytes": 1}, {})
    assert miss.suggestion == NEW


def test_the_python_api_takes_the_old_field_for_a_release(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        config = SiMMConfig(manager_address="local", **{OLD: "1MiB"})
        assert config.local_store_capacity_bytes == 1 << 20
        assert config.embedded_capacity_bytes == 1 << 20
        from_mapping = SiMMConfig.from_mapping({"manager_address": "local", OLD: "1MiB"})
    assert from_mapping == config
    texts = warnings_of(caplog, "sglang_simm.config")
    assert len(texts) == 3 and all(NEW in t and "deprecated" in t for t in texts)
    with pytest.raises(ValueError, match=f"{OLD}.*{NEW}"):
        SiMMConfig(manager_address="local", **{OLD: 1, NEW: 2})


# -- the client flags -------------------------------------------------------------


def test_an_old_client_flag_in_the_config_still_works_and_warns(caplog):
    extra = {"manager_address": "local", "client_flags": {"embedded_eviction": "lru", "embedded_store_dir": "/d"}}
    with caplog.at_level(logging.WARNING, logger="sglang_simm.config"):
        config = load_config(extra, {}).config
    assert dict(config.client_flags) == {"local_store_eviction": "lru", "local_store_dir": "/d"}
    texts = warnings_of(caplog, "sglang_simm.config")
    assert any("embedded_eviction is deprecated: use local_store_eviction" in t for t in texts)
    assert any("embedded_store_dir is deprecated: use local_store_dir" in t for t in texts)
    assert client_flag(extra, "local_store_dir", environ={}) == "/d"
    assert client_flag(extra, "embedded_store_dir", environ={}) == "/d"
    assert with_client_flag(extra, "embedded_store_dir", "/e")["client_flags"] == {
        "local_store_eviction": "lru", "local_store_dir": "/e"}


@pytest.mark.parametrize("flag", ["local_store_error_rate", "embedded_down", "local_store_corrupt_reads"])
def test_a_fault_flag_in_the_config_is_refused_naming_where_fault_injection_went(flag):
    with pytest.raises(ValueError, match=f"{flag}.*faults.py"):
        load_config({"manager_address": "local", "client_flags": {flag: "1"}}, {})


def test_an_old_and_a_new_client_flag_together_are_refused_naming_both():
    extra = {"manager_address": "local", "client_flags": {"embedded_eviction": "lru", "local_store_eviction": "fifo"}}
    with pytest.raises(ValueError) as info:
        load_config(extra, {})
    assert "embedded_eviction" in str(info.value) and "local_store_eviction" in str(info.value)
    env = {"SGLANG_SIMM_CLIENT_FLAGS": json.dumps({"embedded_get_bound": "view", "local_store_get_bound": "view"})}
    with pytest.raises(ValueError, match="embedded_get_bound.*local_store_get_bound"):
        load_config({"manager_address": "local"}, env)


def test_an_old_client_flag_reaches_the_local_store(caplog):
    from sglang_simm import local_store

    with caplog.at_level(logging.WARNING, logger="sglang_simm.local_store"):
        assert local_store.set_flag("embedded_get_bound", "region")
        assert local_store.get_flag("local_store_get_bound") == "region"
        assert local_store.get_flag("embedded_get_bound") == "region"
        assert not local_store.set_flag("embedded_get_bound", "nowhere")  # still validated as the new flag
    texts = warnings_of(caplog, "sglang_simm.local_store")
    assert texts and all("embedded_get_bound is deprecated: use local_store_get_bound" in t for t in texts)


def test_the_new_flags_set_quietly(caplog):
    from sglang_simm import local_store

    with caplog.at_level(logging.WARNING):
        assert local_store.set_flag("local_store_eviction", "lru")
        assert local_store.get_flag("local_store_eviction") == "lru"
        local_store.set_flag("local_store_eviction", "fifo")
        load_config({"manager_address": "local", NEW: "1MiB", "client_flags": {"local_store_get_bound": "view"}}, {})
    assert [r for r in caplog.records if "deprecated" in r.getMessage()] == []


# -- doctor's view ------------------------------------------------------------------


def test_doctor_lists_old_names_and_writes_launch_lines_with_the_new(tmp_path):
    path = tmp_path / "simm.json"
    path.write_text(json.dumps({"client_flags": {"embedded_eviction": "lru"}}))
    extra = {"manager_address": "local", OLD: "1GiB", "client_flags": '{"embedded_idle_exit_s": 3, "a": 1}'}
    lines = find_deprecated_names(extra, {CONFIG_PATH_ENV: str(path), OLD_VAR: "1GiB"})
    assert len(lines) == 4
    for old, new in [(OLD, NEW), ("embedded_idle_exit_s", "local_store_idle_exit_s"),
                     ("embedded_eviction", "local_store_eviction"),
                     (OLD_VAR, NEW_VAR)]:
        assert any(f"{old} is deprecated: use {new}" in line for line in lines), old
    assert with_current_names(extra) == {"manager_address": "local", NEW: "1GiB",
                                         "client_flags": {"local_store_idle_exit_s": 3, "a": 1}}
    assert find_deprecated_names(with_current_names(extra), {}) == []
