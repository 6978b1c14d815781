"""``sglang-simm doctor`` against the embedded store and misconfigurations."""

from __future__ import annotations

import json

from sglang_simm.tools.cli import main


def doctor(capsys, *args, sysfs=None):
    extra = ["--sysfs-root", str(sysfs)] if sysfs else []
    code = main(["doctor", *args, *extra])
    out = capsys.readouterr().out
    return code, " ".join(out.split())  # rich wraps long lines


def test_embedded_store_passes_with_a_round_trip(capsys, store_name):
    code, out = doctor(capsys, "--manager", f"local://{store_name}")
    assert code == 0, out
    assert "Round trip to host store" in out and "No problem found" in out
    assert "manager_address" in out and "extra_config" in out  # the source of the field
    assert "--hicache-storage-backend simm" in out and '"interface_v1": 1' in out


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
    from sglang_simm.embedded import get_server, reset_servers

    get_server(store_name).faults.configure(down=True)
    try:
        code, out = doctor(capsys, "--manager", f"local://{store_name}")
    finally:
        reset_servers(store_name)
    assert code == 1 and "connect" in out and "doctor" in out
