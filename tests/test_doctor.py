"""``sglang-simm doctor`` against the local store and misconfigurations."""

from __future__ import annotations

import json

import pytest

from sglang_simm.tools.cli import main


def doctor(capsys, *args, sysfs=None):
    extra = ["--sysfs-root", str(sysfs)] if sysfs else []
    code = main(["doctor", *args, *extra])
    out = capsys.readouterr().out
    return code, " ".join(out.split())  # rich wraps long lines


def test_embedded_store_passes_with_a_round_trip(capsys, store_name):
    code, out = doctor(capsys, "--manager", f"local://{store_name}")
    assert code == 0, out
    assert "Round trip to local store" in out and "No problem found" in out
    assert "manager_address" in out and "extra_config" in out  # the source of the field
    assert "--hicache-storage-backend simm" in out and '"interface_v1": 1' in out


def test_the_launch_lines_carry_the_recommended_settings_each_with_why(capsys, store_name):
    from sglang_simm.tools.doctor import RECOMMENDED

    code = main(["doctor", "--manager", f"inprocess://{store_name}"])
    lines = capsys.readouterr().out.split("Launch lines")[1].splitlines()
    commands = [line for line in lines if line.startswith("python -m sglang.launch_server")]
    assert code == 0 and len(commands) == 2
    for flag, _why in RECOMMENDED:
        assert all(flag in command for command in commands), flag
        assert any(line.startswith(f"# {flag}: ") for line in lines), flag
    [ratio] = [line for line in lines if line.startswith("# --hicache-ratio 2: ")]
    assert "free host memory" in ratio and "Not enough host memory available" in ratio


def test_wrong_address_names_the_field_and_fails(capsys):
    code, out = doctor(capsys, "--manager", "10.0.0.1")
    assert code == 1
    assert "manager_address" in out and "'10.0.0.1'" in out and "port" in out


def test_missing_address_says_how_to_set_it(capsys, monkeypatch):
    monkeypatch.delenv("SIMM_CLUSTER_MANAGER", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_SIMM_CONFIG_PATH", raising=False)
    code, out = doctor(capsys)
    assert code == 1
    assert "SIMM_CLUSTER_MANAGER" in out and "local" in out


def test_real_cluster_without_client_or_rdma_gives_one_clear_fix(capsys, tmp_path):
    (tmp_path / "class").mkdir()  # a sysfs with no infiniband class
    code, out = doctor(capsys, "--manager", "10.0.0.1:30001", sysfs=tmp_path)
    assert code == 1
    assert "problem" in out
    # either the client is missing or RDMA is: each problem names what to change
    assert "pip uninstall simm" in out or "github.com/scitix/SiMM" in out
    assert "manager_address to 'local'" in out


def test_extra_config_file_form_is_read(capsys, tmp_path, store_name):
    path = tmp_path / "simm.json"
    path.write_text(json.dumps({"manager_address": f"local://{store_name}", "extra_backend_tag": "t1"}))
    code, out = doctor(capsys, "--extra-config", f"@{path}")
    assert code == 0, out
    assert "t1" in out


def test_bad_json_is_an_error_not_a_traceback(capsys):
    code, out = doctor(capsys, "--extra-config", "{not json")
    assert code == 2 and "error" in out


def test_down_store_is_reported(capsys, store_name):
    from sglang_simm.local_store import reset_servers
    from sglang_simm_dev.faults import configure_faults

    configure_faults(store_name, down=True)
    try:
        code, out = doctor(capsys, "--manager", f"local://{store_name}")
    finally:
        reset_servers(store_name)
    assert code == 1 and "connect" in out and "doctor" in out


def launch_line_count(out: str) -> int:
    return out.count("--hicache-storage-backend-extra-config")


def test_a_misspelt_key_of_ours_is_a_problem_and_stays_out_of_the_launch_lines(capsys, store_name):
    """The backend starts with it (it ignores the key, warning), so the
    setting meant silently does not apply: doctor, a deployment's gate,
    exits 1 naming the right key; the round trip still runs."""
    extra = json.dumps({"manager_address": f"inprocess://{store_name}", "key_shceme": "legacy"})
    code, out = doctor(capsys, "--extra-config", extra)
    assert code == 1, out
    assert "problem: configuration: unknown key 'key_shceme' in extra_config is ignored; did you mean 'key_scheme'?" in out
    assert "?." not in out and "1 problem(s)" in out
    assert "Round trip to in-process local store" in out
    assert launch_line_count(out) == 2 and "key_shceme" not in out.split("Launch lines")[1].split("problem:")[0]


def test_an_unknown_key_like_none_of_ours_is_a_warning(capsys, store_name):
    extra = json.dumps({"manager_address": f"inprocess://{store_name}", "zzz": 1})
    code, out = doctor(capsys, "--extra-config", extra)
    assert code == 0, out
    assert "warning: configuration: unknown key 'zzz' in extra_config is ignored" in out and "1 warning(s)" in out


def test_sglangs_own_keys_stay_quiet(capsys, store_name):
    extra = json.dumps({"manager_address": f"inprocess://{store_name}", "prefetch_threshold": 64,
                        "tp_lcm_size": 2, "interface_v1": 1, "file_storage_path": "/x"})
    code, out = doctor(capsys, "--extra-config", extra)
    assert code == 0 and "No problem found" in out, out


@pytest.mark.parametrize(("variable", "meant"), [
    ("SIMM_CLUSTER_MANGER", "SIMM_CLUSTER_MANAGER"),
    ("SGLANG_HICACHE_SIMM_CONFIG", "SGLANG_HICACHE_SIMM_CONFIG_PATH"),
    ("sglang_simm_request_timeout_ms", "SGLANG_SIMM_REQUEST_TIMEOUT_MS"),
    ("SGLANG_SIMM_REQUEST_TIMOUT_MS", "SGLANG_SIMM_REQUEST_TIMEOUT_MS"),
    ("SGLANG_SIMM_STORE_DRI", "SGLANG_SIMM_STORE_DIR"),
], ids=lambda v: v)
def test_a_misspelt_variable_is_a_problem_said_once(host_store_dir, store_name, variable, meant):
    """Run as an operator runs it, on the local store (whose directory
    doctor reads from the sources once more): every line it prints, the
    config's log included, names the variable once, and no sentence ends
    in "?."."""
    import os
    import subprocess
    import sys

    env = {**os.environ, variable: "/nowhere" if "CONFIG" in variable or "DIR" in variable else "10.0.0.1:30001"}
    proc = subprocess.run([sys.executable, "-m", "sglang_simm", "doctor", "--manager", f"local://{store_name}"],
                          capture_output=True, text=True, env=env, timeout=120)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, text
    assert text.count(f"unknown variable {variable} in the environment is ignored; did you mean {meant}?") == 1, text
    assert text.count("unknown variable") == 1 and "?." not in text, text


def test_an_old_name_is_a_warning_naming_the_new_one_and_the_launch_lines_use_the_new(capsys, store_name):
    extra = json.dumps({"manager_address": f"inprocess://{store_name}", "embedded_capacity_bytes": "64MiB",
                        "client_flags": {"embedded_eviction": "lru"}})
    code, out = doctor(capsys, "--extra-config", extra)
    assert code == 0, out
    assert "embedded_capacity_bytes is deprecated: use local_store_capacity_bytes" in out
    assert "client flag embedded_eviction is deprecated: use local_store_eviction" in out
    assert "unknown key" not in out and "2 warning(s)" in out
    lines = out.split("Launch lines")[1].split("warning:")[0]
    assert launch_line_count(out) == 2 and "embedded_" not in lines
    assert "local_store_capacity_bytes" in lines and "local_store_eviction" in lines


def test_a_misspelt_key_in_the_config_file_is_a_problem_naming_the_file(capsys, monkeypatch, tmp_path, store_name):
    # a path longer than the 80 columns pytest-xdist's workers set: rich used
    # to fold it mid-word, so the warning named no file one could copy
    monkeypatch.setenv("COLUMNS", "80")
    (tmp_path / ("d" * 64)).mkdir()
    path = tmp_path / ("d" * 64) / "simm.json"
    path.write_text(json.dumps({"manager_address": f"inprocess://{store_name}", "warm_up": False}))
    monkeypatch.setenv("SGLANG_HICACHE_SIMM_CONFIG_PATH", str(path))
    code, out = doctor(capsys)
    assert code == 1, out
    assert f"unknown key 'warm_up' in file:{path}" in out and "did you mean 'warmup'?" in out


def test_a_manager_that_accepts_no_connection_is_named(capsys, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        (tmp_path / "class").mkdir()
        code, out = doctor(capsys, "--manager", f"127.0.0.1:{port}", sysfs=tmp_path)
    assert code == 1
    assert f"the cluster manager 127.0.0.1:{port} does not accept a TCP connection" in out


def test_a_running_local_store_of_another_size_is_a_warning_and_none_is_left_running(capsys, host_store_dir):
    import uuid

    from sglang_simm.local_store._handle import StoreHandle
    from sglang_simm.local_store._paths import store_names

    name = f"doc-{uuid.uuid4().hex[:6]}"
    # none running: the round trip runs on a store of doctor's own, which it stops
    code, out = doctor(capsys, "--manager", f"local://{name}")
    assert code == 0 and "No problem found" in out, out
    assert "no local store" in out and "runs on a store of doctor's own" in out
    assert name not in store_names(host_store_dir)  # nothing of that name started or left

    store = StoreHandle(name, root=host_store_dir, capacity=64 << 20)
    store.open()
    try:
        # a configuration that asks for no capacity gets the running store's, and no warning
        code, out = doctor(capsys, "--manager", f"local://{name}")
        assert code == 0 and "No problem found" in out and "capacity 64.0 MiB" in out, out
        extra = json.dumps({"manager_address": f"local://{name}", "local_store_capacity_bytes": "4GiB"})
        code, out = doctor(capsys, "--extra-config", extra)
        assert code == 0, out
        assert "asks for 4.0 GiB, and the running local store" in out and "has 64.0 MiB" in out
        assert out.count("asks for 4.0 GiB") == 1  # said once
        assert f"sglang-simm store stop {name}" in out and "No problem found" not in out
    finally:
        store.stop(discard=True)
        store.close()


def test_invalid_configuration_gets_no_launch_lines(capsys):
    code, out = doctor(capsys, "--extra-config", '{"manager_address": "local", "request_timeout_ms": -5}')
    assert code == 1
    assert launch_line_count(out) == 0 and "HOST:PORT" not in out


@pytest.mark.parametrize("where", ["env", "file"])
def test_address_from_the_environment_or_a_file_is_not_pasted_over(capsys, monkeypatch, tmp_path, store_name, where):
    address = f"inprocess://{store_name}"
    monkeypatch.delenv("SIMM_CLUSTER_MANAGER", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_SIMM_CONFIG_PATH", raising=False)
    if where == "env":
        monkeypatch.setenv("SIMM_CLUSTER_MANAGER", address)
        source = "env:SIMM_CLUSTER_MANAGER"
    else:
        path = tmp_path / "simm.json"
        path.write_text(json.dumps({"manager_address": address}))
        monkeypatch.setenv("SGLANG_HICACHE_SIMM_CONFIG_PATH", str(path))
        source = f"file:{path}"
    code, out = doctor(capsys, "--extra-config", '{"extra_backend_tag": "t1"}')
    assert code == 0, out
    assert launch_line_count(out) == 2
    assert "HOST:PORT" not in out
    lines = [line for line in out.split("python -m sglang.launch_server")[1:]]
    assert all('"extra_backend_tag": "t1"' in line and "manager_address" not in line.split("#")[0]
               for line in lines)
    assert f"manager_address comes from {source}" in out


def test_local_store_with_another_bad_field_names_that_field(capsys):
    code, out = doctor(capsys, "--extra-config", '{"manager_address": "local", "clnt_threadpool_size": 0}')
    assert code == 1
    assert "clnt_threadpool_size=0 (from extra_config) is out of range" in out
    assert "set manager_address to 'local'" not in out and "simm.kv" not in out
    assert "local store 'default'" in out


def test_without_sglang_the_hint_is_a_command_that_works_and_shows_whole(capsys, monkeypatch, store_name):
    # rich read "[sglang]" in the old hint as markup and printed
    # pip install 'sglang-simm', naming a package no index has
    from sglang_simm.tools import doctor as doctor_module

    monkeypatch.setattr(doctor_module, "sglang_status", lambda: {
        "version": None, "entry_point": None, "plugin_route": False, "dynamic_route": False,
        "other_simm_entry_points": ["[weird] plugin"],
    })
    code, out = doctor(capsys, "--manager", f"local://{store_name}")
    assert "SGLang is not installed here: pip install 'sglang>=0.5.8,<0.6'" in out, out
    assert "sglang-simm'" not in out
    assert "[weird] plugin" in out  # values are shown as they are, brackets included


def test_a_capacity_no_store_can_start_with_is_a_problem_named_within_seconds(capsys, host_store_dir):
    """A memory store of 100 TiB: no client could map its segment. doctor
    says so, naming the field, before starting anything (it hung 74 s, then
    blamed the manager address)."""
    import time

    extra = json.dumps({"manager_address": "local://huge", "local_store_capacity_bytes": "100TiB"})
    t0 = time.monotonic()
    code, out = doctor(capsys, "--extra-config", extra)
    assert code == 1 and time.monotonic() - t0 < 20, out
    assert "problem: local_store_capacity_bytes" in out and out.count("problem:") == 1, out
