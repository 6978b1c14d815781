"""Smoke test of ``sglang-simm bench``: a tiny run, its JSON, and the checks
it makes of every backend's results. No timing is asserted."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
pytest.importorskip("rich")

from rich.console import Console  # noqa: E402

from sglang_simm.tools import bench, nullkv  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = argparse.Namespace(pages="1,8", repeat=2, quick=False, json=str(out), plot=None,
                              bandwidth_cases=["small"], bandwidth_pages=2)
    text = io.StringIO()
    rc = bench.run_bench(Console(file=text, width=140, force_terminal=False), args)
    return rc, json.loads(out.read_text()), text.getvalue()


def test_exit_code_and_output(tiny_run):
    rc, result, text = tiny_run
    assert rc == 0, result["checks"]["failures"]
    for title in ("Own overhead per call, null client", "Per call on the embedded store",
                  "Bandwidth", "Goals", "results verified"):
        assert title in text


def test_json_structure(tiny_run):
    _, result, _ = tiny_run
    assert set(result) >= {"machine", "settings", "overhead", "bandwidth", "scaling", "goals", "checks"}
    m = result["machine"]
    assert {"cpu", "cores", "torch", "sglang", "python"} <= set(m)
    assert m["cpu"] and m["cores"] >= 1
    rows = {(r["client"], r["op"], r["pages"]): r for r in result["overhead"]}
    assert set(rows) == {(c, op, n) for c in ("null", "embedded") for op in bench.OPS for n in (1, 8)}
    for r in rows.values():
        assert r["ours_us"] > 0 and r["intree_us"] > 0 and r["samples"] == 2
        assert r["ratio"] == pytest.approx(r["intree_us"] / r["ours_us"])
        assert r["ours_us_per_page"] == pytest.approx(r["ours_us"] / r["pages"])
    (bw,) = result["bandwidth"]
    assert bw["case"] == "small" and bw["pages"] == 2
    for key in ("set_gbps", "get_gbps", "torch_gbps", "set_ratio", "get_ratio"):
        assert bw[key] > 0
    assert set(result["scaling"]) == {"null", "embedded"}
    for goal in result["goals"]:
        assert {"goal", "target", "value", "met"} <= set(goal)
        # 128 pages and 8..1024 scaling were not measured in this run
        if "128 pages" in goal["goal"] or "8..1024" in goal["goal"]:
            assert goal["met"] is None and goal["value"] is None


def test_results_were_verified(tiny_run):
    _, result, _ = tiny_run
    checks = result["checks"]
    assert checks["ok"] and not checks["failures"]
    verified = checks["verified"]
    for client in ("null", "embedded"):
        for backend in ("ours", "in-tree"):
            # each backend reached the client under test through simm.kv
            assert verified[f"{client}/{backend}/client"] is True
            for op in ("store", *bench.OPS):
                assert verified[f"{client}/{backend}/{op}"] is True
    assert verified["embedded/bytes"] is True
    assert verified["bandwidth/small/set"] and verified["bandwidth/small/get"]
    assert verified["bandwidth/small/bytes"] is True


def test_no_simm_alias_left_behind(tiny_run):
    assert "simm.kv" not in sys.modules or not getattr(sys.modules["simm.kv"], "__simm_null__", False)
    assert bench.INTREE_MODULE not in sys.modules or sys.modules[bench.INTREE_MODULE] is not None


def test_checks_catch_wrong_results():
    checks = bench.Checks()
    bench.check_result(checks, "x/get", "get", [True, False], 2)
    bench.check_result(checks, "x/exists", "exists", 1, 2)
    bench.check_result(checks, "y/set", "set", [True, True], 2)
    assert not checks.ok
    assert checks.items == {"x/get": False, "x/exists": False, "y/set": True}


def test_intree_class_binds_the_given_client():
    cls = bench.load_intree_class(nullkv)
    assert cls.__init__.__globals__["Store"] is nullkv.Store
    assert cls.__init__.__globals__["BlockView"] is nullkv.BlockView
    from sglang_simm import embedded

    cls2 = bench.load_intree_class(embedded)
    assert cls2.__init__.__globals__["Store"] is embedded.Store
    assert cls2 is not cls


def test_null_client_answers():
    store = nullkv.Store()
    mr = nullkv.register_mr(__import__("torch").zeros(16, dtype=__import__("torch").uint8))
    views = [nullkv.BlockView.from_buffer(0, 7, mr), nullkv.BlockView.from_buffer(0, 9, mr)]
    assert store.mget(["a", "b"], views) == [7, 9]
    assert store.mput(["a", "b"], views) == [0, 0]
    store.exists_answer = False
    assert store.mexists(["a", "b"]) == [False, False]
    block = store.allocate(8)
    block.as_ref()[:] = 5
    assert store.put("k", block.view()) == 0 and store.exists("k")
    other = store.allocate(8)
    assert store.get("k", other.view()) == 8 and bool((other.as_ref() == 5).all())


def test_plan_quick_and_pages():
    quick = bench.plan_from_args(argparse.Namespace(pages=bench.DEFAULT_PAGES, repeat=30, quick=True))
    assert quick.sizes == [1, 8, 128, 1024] and quick.repeat <= 7
    full = bench.plan_from_args(argparse.Namespace(pages="128,8", repeat=5, quick=False))
    assert full.sizes == [8, 128] and full.repeat == 5
    with pytest.raises(ValueError):
        bench.plan_from_args(argparse.Namespace(pages="a,b", repeat=5, quick=False))
    with pytest.raises(ValueError):
        bench.plan_from_args(argparse.Namespace(pages="8", repeat=5, quick=False, bandwidth_cases=["nope"]))


def test_plot(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, result, _ = tiny_run
    path = tmp_path / "bench.png"
    bench.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
