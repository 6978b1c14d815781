"""Smoke test of ``sglang-simm-dev bench``: a tiny run, its JSON, and the checks
it makes of every backend's results. No timing is asserted."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
pytest.importorskip("rich")

from rich.console import Console  # noqa: E402

from sglang_simm.local_store._paths import STORE_DIR_ENV  # noqa: E402
from sglang_simm_dev import bench, nullkv  # noqa: E402


@pytest.fixture(scope="module")
def store_parent(host_store_dir):
    """The store directory the tiny run is started in: one of its own, so
    what it leaves is told apart from what other tests of this worker left
    in the session's directory (whose stores keep their lock and log files
    by design)."""
    parent = tempfile.mkdtemp(prefix="bench-parent-", dir=host_store_dir)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, store_parent):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = argparse.Namespace(pages="1,8", repeat=2, quick=False, json=str(out), plot=None,
                              bandwidth_cases=["small"], bandwidth_pages=2)
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_DIR_ENV, store_parent)
        rc = bench.run_bench(Console(file=text, width=140, force_terminal=False), args)
    return rc, json.loads(out.read_text()), text.getvalue()


def test_exit_code_and_output(tiny_run):
    rc, result, text = tiny_run
    assert rc == 0, result["checks"]["failures"]
    for title in ("Own overhead per call, null client", "Per call on the local store",
                  "Longest GIL hold per call", "Bandwidth", "Goals", "results verified"):
        assert title in text


def test_json_structure(tiny_run):
    _, result, _ = tiny_run
    assert set(result) >= {"machine", "settings", "operations", "overhead", "bandwidth", "scaling", "gil",
                           "goals", "checks"}
    assert list(result["operations"]) == ["set", "exists", "get", "get-cold"]
    m = result["machine"]
    assert {"cpu", "cores", "torch", "sglang", "python"} <= set(m)
    assert m["cpu"] and m["cores"] >= 1
    rows = {(r["client"], r["op"], r["pages"]): r for r in result["overhead"]}
    assert set(rows) == {(c, op, n) for c in ("null", "local") for op in bench.OPS for n in (1, 8)}
    for r in rows.values():
        assert r["ours_us"] > 0 and r["intree_us"] > 0 and r["samples"] == 2
        assert r["clock"] == ("thread_time" if r["client"] == "null" else "perf_counter")
        assert r["ratio"] == pytest.approx(r["intree_us"] / r["ours_us"])
        assert r["ours_us_per_page"] == pytest.approx(r["ours_us"] / r["pages"])
    (bw,) = result["bandwidth"]
    assert bw["case"] == "small" and bw["pages"] == 2
    for key in ("set_gbps", "get_gbps", "torch_gbps", "set_ratio", "get_ratio"):
        assert bw[key] > 0
    assert set(result["scaling"]) == {"null", "local"}
    gil = {(r["op"], r["pages"]): r for r in result["gil"]["rows"]}
    assert set(gil) == {(op, n) for op in bench.OPS for n in (1, 8)}
    for r in gil.values():
        assert 0 < r["ours_us"] <= r["ours_max_us"] and 0 < r["intree_us"] <= r["intree_max_us"]
        # the null client was called (and let go of the GIL) at least once per call
        assert r["ours_batch_calls"] >= 1 and r["intree_batch_calls"] >= 1
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
    for client in ("null", "local"):
        for backend in ("ours", "in-tree"):
            # each backend reached the client under test through simm.kv
            assert verified[f"{client}/{backend}/client"] is True
            for op in bench.OPS:
                assert verified[f"{client}/{backend}/{op}"] is True
    assert verified["local/bytes"] is True
    assert verified["bandwidth/small/set"] and verified["bandwidth/small/get"]
    assert verified["bandwidth/small/bytes"] is True


def test_no_simm_alias_left_behind(tiny_run):
    assert "simm.kv" not in sys.modules or not getattr(sys.modules["simm.kv"], "__simm_null__", False)
    assert bench.INTREE_MODULE not in sys.modules or sys.modules[bench.INTREE_MODULE] is not None


def test_the_stores_a_run_starts_leave_nothing_in_the_store_directory(tiny_run, store_parent):
    """Its local stores live in a directory of the run's own, removed with
    their lock and log files when it ends."""
    assert tiny_run[0] == 0
    assert os.listdir(store_parent) == []


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
    from sglang_simm import local_store

    cls2 = bench.load_intree_class(local_store)
    assert cls2.__init__.__globals__["Store"] is local_store.Store
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
    for bad in (0, -2):  # refused, not run with the default
        with pytest.raises(ValueError, match="--repeat must be >= 1"):
            bench.plan_from_args(argparse.Namespace(pages="8", repeat=bad, quick=False))
    with pytest.raises(ValueError):
        bench.plan_from_args(argparse.Namespace(pages="8", repeat=5, quick=False, bandwidth_cases=["nope"]))


def test_plot(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, result, _ = tiny_run
    path = tmp_path / "bench.png"
    bench.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_key_ring_never_repeats_a_key_within_a_cache_length():
    KEY_CACHE_LIMIT = 1 << 15  # a cache's length, in keys, that the ring outlasts

    ring = bench.KeyRing(bench.page_keys(2 * KEY_CACHE_LIMIT + 2 * 1024, "t"))
    assert ring.peek(2, 3) == [ring.keys[0:3], ring.keys[3:6]] and ring.pos == 0
    last_seen: dict[str, int] = {}
    handed = 0
    for n in [1, 8, 128, 1024, 7] * 130:
        for key in ring.take(n):
            if key in last_seen:
                assert handed - last_seen[key] > KEY_CACHE_LIMIT
            last_seen[key] = handed
            handed += 1
    assert handed > len(ring.keys)  # it did wrap around
    with pytest.raises(ValueError):
        ring.take(len(ring.keys) + 1)


def test_serving_pattern_new_keys_every_call_and_a_get_reads_what_its_exists_looked_up():
    """What the rig times: new keys for set, exists and get-cold; a get of the
    keys its exists (untimed) just looked up. The client sees which."""
    from sglang_simm_dev.pools import build_host_pool

    geom = bench.OVERHEAD_GEOMETRY
    rig = bench.OverheadRig("null", 8, pool=build_host_pool(geom, tokens=16 * geom.page_size))
    try:
        client = rig.backends["ours"].client
        seen: list[tuple[str, tuple[str, ...]]] = []
        for name in ("mexists_codes", "mget_views", "mput_views"):
            original = getattr(client, name)

            def spy(keys, *rest, _name=name.split("_")[0], _original=original):
                seen.append((_name, tuple(keys)))
                return _original(keys, *rest)

            setattr(client, name, spy)
        used: set[str] = set()
        for op in ("set", "exists", "get-cold", "set", "exists"):
            rig.prepare(op)
            t = rig.call("ours", op, 8)
            t.ready()
            seen.clear()
            assert t.fn() in (8, [True] * 8)
            keys = {k for _, ks in seen for k in ks}
            assert len(keys) == 16 and not keys & used  # 8 pages x K, V: none asked for before
            used |= keys
        rig.prepare("get")
        t = rig.call("ours", "get", 8)
        for _ in range(3):
            seen.clear()
            t.prepare(1)
            (looked_up, keys), = seen
            assert looked_up == "mexists" and not set(keys) & used
            seen.clear()
            assert t.fn() == [True] * 8
            assert seen == [("mget", keys)]  # the get reads what the exists looked up
            used |= set(keys)
    finally:
        rig.close()


def test_longest_hold_splits_a_call_at_the_client_calls():
    points: list[float] = []
    store = nullkv.Store()
    store.release_points = points
    mr = nullkv.register_mr(__import__("torch").zeros(8, dtype=__import__("torch").uint8))

    def call():
        t = __import__("time").perf_counter() + 0.004
        while __import__("time").perf_counter() < t:
            pass
        store.mexists(["a"])  # the client lets go of the GIL here
        return store.mget(["a"], [nullkv.BlockView.from_buffer(0, 3, mr)])

    held, releases, result = bench.longest_hold(call, points)
    assert result == [3] and releases == 2
    assert 0.004 <= held < 0.5


def test_null_rig_hands_new_host_pages_every_call_as_sglangs_fifo_allocator_does():
    """No cache of views may answer a call from an earlier one: on the null
    client, each set and get lands on host pages no earlier call of the
    pool's turn used (a rig of fixed pages let a view cache hit every call)."""
    from sglang_simm_dev.pools import build_host_pool

    geom = bench.NULL_GEOMETRY
    rig = bench.OverheadRig("null", 4, geom=geom, pool=build_host_pool(geom, tokens=32 * geom.page_size))
    try:
        client = rig.backends["ours"].client
        seen: list[int] = []
        for name in ("mget_views", "mput_views"):
            original = getattr(client, name)

            def spy(keys, views, *rest, _original=original):
                seen.extend(v.ptr for v in views)
                return _original(keys, views, *rest)

            setattr(client, name, spy)
        for op in ("set", "get-cold"):
            rig.prepare(op)
            t = rig.call("ours", op, 4)
            seen.clear()
            for _ in range(len(rig.src_pages) // 4):  # one turn of the pool's half
                t.fn()
            assert len(seen) == len(set(seen)) == 2 * len(rig.src_pages), op
    finally:
        rig.close()
