"""Smoke test of the disk bench (``python -m sglang_simm_dev.bench.disk``):
its self-describing objects, its reading of dd, its refusal of a run that
does not fit, and a tiny run's JSON. No speed is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from sglang_simm.local_store.admin import medium_of
from sglang_simm_dev.bench import disk


def _pythonpath() -> str:
    """This process's copies of the plugin and the instruments, first on a child's path."""
    import sglang_simm
    import sglang_simm_dev

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (sglang_simm, sglang_simm_dev)]
    return os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])


def test_an_object_wrong_anywhere_is_caught():
    pattern = disk.Pattern(4096)
    numbers = np.arange(6)
    rows = np.empty((6, pattern.words), dtype=np.uint64)
    scratch = np.empty_like(rows)
    pattern.fill(rows, numbers)
    assert not pattern.wrong(rows, numbers, scratch).any()
    rows[1, 100] ^= np.uint64(1 << 40)  # one bit flipped
    rows[2] = np.roll(rows[2], 1)  # torn or shifted: every word in the wrong place
    rows[3, 256:] = rows[4, 256:]  # half of another object
    rows[5] = 0  # a hole
    assert pattern.wrong(rows, numbers, scratch).tolist() == [False, True, True, True, False, True]
    assert pattern.wrong(rows[[4]], np.array([0]), scratch).tolist() == [True]  # object 4's bytes under key 0
    with pytest.raises(ValueError, match="multiple of 8"):
        disk.Pattern(1001)


def test_dd_figures_are_read_from_its_summary_line():
    text = ("512+0 records in\n512+0 records out\n"
            "2147483648 bytes (2.1 GB, 2.0 GiB) copied, 1.1059 s, 1.9 GB/s\n")
    assert disk.parse_dd(text) == (2147483648, 1.1059)
    with pytest.raises(RuntimeError, match="no summary line"):
        disk.parse_dd("dd: failed to open 'x': Permission denied")
    assert [disk.parse_size(s) for s in ("1MiB", "64KiB", "4096", "2G")] == [1 << 20, 64 << 10, 4096, 2 << 30]


def test_a_run_that_does_not_fit_is_refused_saying_what_it_needs(tmp_path):
    if medium_of(str(tmp_path)) != "disk":
        pytest.skip(f"{tmp_path} is no disk")
    why = disk.room_problem(str(tmp_path), 1 << 60, 1 << 30)
    assert "GiB free; the run needs" in why and "lower --gib" in why
    assert disk.room_problem(str(tmp_path), 1 << 20, 1 << 20) is None
    if os.path.isdir("/dev/shm") and medium_of("/dev/shm") == "memory":
        assert "is on memory" in disk.room_problem("/dev/shm", 1 << 20, 1 << 20)
    done = subprocess.run([sys.executable, "-m", "sglang_simm_dev.bench.disk", "--dir", str(tmp_path),
                           "--gib", str(1 << 30)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert done.returncode != 0 and "the run needs" in done.stderr and os.listdir(tmp_path) == []


@pytest.mark.host
def test_a_tiny_run_reads_every_object_back_whole_and_leaves_nothing():
    base = os.environ.get("SGLANG_SIMM_DISK_TEST_DIR") or tempfile.gettempdir()
    if medium_of(base) != "disk":
        pytest.skip(f"{base} is no disk")
    where = tempfile.mkdtemp(prefix="bench-disk-", dir=base)
    out = os.path.join(where, "out.json")
    try:
        done = subprocess.run([sys.executable, "-m", "sglang_simm_dev.bench.disk", "--quick", "--dir", where,
                               "--json", out, "--sizes", "1MiB,64KiB"], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": _pythonpath()})
        assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
        assert os.listdir(where) == ["out.json"]  # the store's files and dd's are gone
        with open(out) as f:
            result = json.load(f)
    finally:
        for name in os.listdir(where):
            os.unlink(os.path.join(where, name))
        os.rmdir(where)
    assert result["bench"] == "disk" and result["wrong"] == 0 and result["missing"] == 0
    assert len(result["dd"]) == 6 and all(d["write_gbps"] > 0 and d["read_gbps"] > 0 for d in result["dd"])
    assert [s["object_bytes"] for s in result["sizes"]] == [1 << 20, 64 << 10]
    for s in result["sizes"]:
        assert s["objects"] * s["object_bytes"] == s["bytes"] > 0
        assert s["refused"] == 0 and s["evictions"] == 0
        assert s["write_gbps"] > 0 and s["read_gbps"] > 0 and s["write_over_dd"] > 0 and s["read_over_dd"] > 0
        assert len(s["write"]["dd_gbps"]) == len(s["read"]["dd_gbps"]) == 2  # dd on either side of each phase
        assert 0 < s["write"]["call_cpu_s"] and 0 < s["read"]["call_cpu_s"] and s["write"]["store_cpu_s"] >= 0
        assert s["rss_anon_peak"] > 0 and s["rss_anon_bytes_per_object"] is not None
        assert s["resident_after_drop"] <= s["bytes"] // 8  # cold: the drop took the page cache
    assert {g["what"] for g in result["goals"]} >= {"objects wrong", "cold read, 1 MiB objects, over dd's",
                                                     "store RssAnon, 1 MiB objects"}
    assert result["settings"]["larger_than_ram"] is False and result["machine"]["disk"]["fs"]
