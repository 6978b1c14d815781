"""``bench --server`` on a disk: ``ours-disk`` (the local store in a
directory on a disk) beside ``file`` on the same disk, the restart's L3
files dropped from the page cache, and the disk's goals."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile

import pytest

from sglang_simm.local_store.admin import medium_of
from sglang_simm_dev.bench.server import disk_goals, plan_from_args
from sglang_simm_dev.bench.server_backends import Environment, Shape
from sglang_simm_dev.bench.server_render import tables


@pytest.fixture
def disk_base():
    base = os.environ.get("SGLANG_SIMM_DISK_TEST_DIR") or tempfile.gettempdir()
    if medium_of(base) != "disk":
        pytest.skip(f"{base} is no disk")
    return base


@pytest.fixture
def env(tmp_path, disk_base):
    made = Environment.create(sys.executable, want_mooncake=False, workdir=str(tmp_path), disk_dir=disk_base,
                              file_on_disk=True)
    yield made
    made.close()


def test_ours_on_a_disk_keeps_its_store_there_and_file_its_folder_beside_it(env):
    shape = Shape(model_path="m", device_tokens=1024)
    disk, ours, file = (env.config(b, shape) for b in ("ours-disk", "ours", "file"))
    store_dir = disk.extra_config["local_store_dir"]
    assert disk.route == "simm" and disk.extra_config["manager_address"] == f"local://{env.tag}-ours-disk"
    assert store_dir.startswith(env.disk_root + os.sep) and medium_of(store_dir) == "disk"
    assert os.stat(store_dir).st_mode & 0o777 == 0o700
    assert "local_store_dir" not in ours.extra_config  # ours stays on /dev/shm
    assert file.extra_config["file_storage_path"].startswith(env.disk_root + os.sep)
    assert env.l3_dir("ours-disk") == store_dir and env.l3_dir("file") == env.file_dir and env.l3_dir("none") is None


def test_the_disk_folder_goes_with_the_environment_and_must_be_a_disk(tmp_path, disk_base):
    made = Environment.create(sys.executable, want_mooncake=False, workdir=str(tmp_path), disk_dir=disk_base)
    root = made.disk_root
    assert medium_of(made.file_dir) == ("memory" if os.path.isdir("/dev/shm") else "disk")  # file stays put
    made.close()
    assert not os.path.exists(root)
    if os.path.isdir("/dev/shm") and medium_of("/dev/shm") == "memory":
        with pytest.raises(ValueError, match="--disk-dir must be a directory on a disk"):
            Environment.create(sys.executable, want_mooncake=False, workdir=str(tmp_path), disk_dir="/dev/shm")
    with pytest.raises(RuntimeError, match="needs a folder on a disk"):
        Environment(tag="t", root=str(tmp_path), tap_dir="", mooncake=None, file_dir="").store_dir_of("ours-disk")


def test_the_restart_reads_the_l3_files_of_a_disk_cold(env):
    """Between the stop and the restart the bench drops each L3 backend's
    files on a disk from the page cache: the store's segment and index,
    every file of ``file``'s folder. On memory there is nothing to drop."""
    from sglang_simm.simm_rules import OK

    env.hold_store(Shape(model_path="m", l3_bytes=64 << 20), backend="ours-disk")
    handle = env.held[env.store_of("ours-disk")]
    bufs = [ctypes.create_string_buffer(b"x" * (1 << 20), 1 << 20) for _ in range(8)]
    assert handle.put_from([(f"k{i}", ctypes.addressof(b), 1 << 20) for i, b in enumerate(bufs)], True) == [OK] * 8
    with open(os.path.join(env.file_dir, "page.bin"), "wb") as f:
        f.write(os.urandom(8 << 20))
    for name in ("ours-disk", "file"):
        got = env.drop_l3_cache(name)
        assert got["medium"] == "disk" and got["dropped"] and got["files"] >= 1 and got["bytes"] >= 8 << 20, got
        assert got["resident_before"] >= 4 << 20 and got["resident_after"] < 1 << 20, got
    # every object still there, read from the disk
    out = [ctypes.create_string_buffer(1 << 20) for _ in range(8)]
    assert handle.get_into([(f"k{i}", ctypes.addressof(b), 1 << 20) for i, b in enumerate(out)]) == [1 << 20] * 8
    assert all(b.raw == b"x" * (1 << 20) for b in out)
    assert env.drop_l3_cache("none") == {"dir": None, "medium": None, "dropped": False}


def test_ours_disk_is_a_backend_and_takes_a_disk_dir(disk_base):
    plan = plan_from_args(argparse.Namespace(backends="ours,ours-disk,file,none", small=True, disk_dir=disk_base))
    assert plan.backends == ["ours", "ours-disk", "file", "none"] and plan.disk_dir == disk_base


def _result(hot: dict[str, list[float]], cold: dict[str, list[float]]) -> dict:
    long = {n: [{"requests": [{"label": "after flush", "ttft_s": t, "cached": {"host": 0, "storage": 496}}],
                 "expected_prefix": 496} for t in ts] for n, ts in hot.items()}
    restart = {n: {"prompts": len(ts), "l3_hits": len(ts), "same_answers": len(ts), "backup_s": 1.0,
                   "ttft_s": ts, "l3_tokens": [496] * len(ts), "expected_l3_tokens": [496] * len(ts),
                   "page_cache": {"dir": "/d", "medium": "disk", "dropped": True, "files": 3, "bytes": 1 << 30,
                                  "resident_before": 24 << 20, "resident_after": 0}} for n, ts in cold.items()}
    return {"settings": {"backends": ["ours-disk", "file"], "repeat": 2,
                         "workload": {"long_tokens": 512, "rounds": 2},
                         "l3_dirs": {"ours-disk": {"dir": "/d/s", "medium": "disk"},
                                     "file": {"dir": "/d/f", "medium": "disk"}}},
            "summary": {}, "long_prompt": long, "multi_turn": {}, "per_op": {}, "histograms": {}, "goals": [],
            "restart": restart, "itl": {}}


def test_the_disk_goals_compare_ours_disk_with_file_hot_and_cold():
    result = _result(hot={"ours-disk": [0.50, 0.60], "file": [0.70, 0.80]},
                     cold={"ours-disk": [0.9, 1.0, 1.2], "file": [0.8, 0.85, 0.9]})
    goals = disk_goals(result)
    assert [(g["what"].split(",")[1].strip().split()[0], g["met"]) for g in goals] == [("hot", True), ("cold", False)]
    hot, cold = goals
    assert hot["value"] == pytest.approx(0.55) and hot["other"] == pytest.approx(0.75)
    assert hot["each"] == [0.50, 0.60] and cold["other_each"] == [0.8, 0.85, 0.9]
    assert cold["ratio"] == pytest.approx(1.0 / 0.85)
    result["disk_goals"] = goals
    by_title = {t[0].split(" (")[0].split(":")[0]: (header, rows) for t in tables(result) for header, rows in [t[1:]]}
    header, rows = by_title["Restart on the same L3"]
    assert rows[0][:4] == ["ours (local store on a disk)", "3/3", "1488/1488", "1000 (900-1200)"]
    assert rows[1][0] == "file (disk)" and rows[1][-1] == "24 / 0"
    header, rows = by_title["The local store on a disk against SGLang's file backend on the same disk"]
    assert [r[-1] for r in rows] == ["met", "missed"] and rows[0][3:6] == ["550", "750", "500, 600 vs 700, 800"]


def test_no_disk_goal_without_ours_disk_or_its_peer():
    result = _result(hot={"ours-disk": [0.5]}, cold={})
    assert disk_goals(result) == []
    result["settings"]["backends"] = ["file"]
    assert disk_goals(result) == []


@pytest.mark.e2e
def test_quick_bench_on_a_disk(tmp_path, disk_base):
    """Two real servers (the tiny model) on one disk: the long prompt and a
    restart whose L3 files were dropped from the page cache; both serve
    every restarted prompt from L3, with the same answers."""
    from sglang_simm_dev.bench.server import run

    plan = plan_from_args(argparse.Namespace(quick=True, backends="ours-disk,file", workloads="long,restart",
                                             disk_dir=disk_base))
    plan.workdir = str(tmp_path / "work")
    plan.model_dir = str(tmp_path / "model")
    result = run(plan)
    assert result["checks"]["ok"], result["checks"]["failures"]
    assert {d["medium"] for d in result["settings"]["l3_dirs"].values()} == {"disk"}
    for name in ("ours-disk", "file"):
        d = result["restart"][name]
        assert d["l3_hits"] == d["prompts"] == 2 and d["l3_tokens"] == d["expected_l3_tokens"]
        assert len(d["ttft_s"]) == 2 and d["page_cache"]["dropped"] and d["page_cache"]["files"] >= 1
    assert [g["what"].split(",")[1].strip().split()[0] for g in result["disk_goals"]] == ["hot", "cold"]
    assert not [p for p in os.listdir(disk_base) if p.startswith(f"sglang-simm-bench-{os.getpid()}-")]
