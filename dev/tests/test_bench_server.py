"""``sglang-simm-dev bench --server``: its pieces, and the whole harness on a tiny
model with the ``file`` backend and ours (one repetition), so it cannot rot."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import pytest

from sglang_simm_dev.bench import server_metrics, server_tap
from sglang_simm_dev.bench.report import write_docs_section
from sglang_simm_dev.bench.server import _error_line, _failure, checks, goals, plan_from_args
from sglang_simm_dev.bench.server_backends import (
    MOONCAKE_INSTALL,
    Environment,
    MooncakeClient,
    MooncakeMaster,
    Shape,
    mooncake_status,
)
from sglang_simm_dev.bench.server_workloads import (
    Workload,
    compare_turns,
    conversation_prompts,
    matchable,
    rotated,
)
from sglang_simm_dev.sglang_server import ServerConfig, server_env

# -- the servers' command lines ------------------------------------------------------


def test_no_hicache_drops_every_hicache_flag_and_sleep_on_idle_is_passed():
    args = ServerConfig(model_path="m", hierarchical_cache=False, sleep_on_idle=True).launch_args(1234)
    assert not [a for a in args if a.startswith("--hicache") or a == "--enable-hierarchical-cache"], args
    assert "--sleep-on-idle" in args
    default = ServerConfig(model_path="m").launch_args(1234)
    assert "--enable-hierarchical-cache" in default and "--sleep-on-idle" not in default


@pytest.mark.parametrize("route", ["file", "mooncake"])
def test_sglangs_own_backends_are_named_with_their_own_extra_config(route):
    args = ServerConfig(model_path="m", route=route, extra_config={"k": 1}).launch_args(1)
    i = args.index("--hicache-storage-backend")
    assert args[i + 1] == route
    assert json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1]) == {"k": 1}
    with pytest.raises(ValueError, match="route must be one of"):
        ServerConfig(model_path="m", route="nope").launch_args(1)


def test_extra_pythonpath_comes_after_the_standins(tmp_path):
    env = server_env(ServerConfig(model_path="m", pythonpath=("/tap",)), str(tmp_path))
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == str(tmp_path / "site") and parts[1] == "/tap"


def test_each_backend_gets_its_own_l3_and_the_same_shape(tmp_path):
    env = Environment(tag="t", root=str(tmp_path), tap_dir=str(tmp_path / "tap"),
                      mooncake=mooncake_status(sys.executable), file_dir=str(tmp_path / "f"))
    shape = Shape(model_path="m", device_tokens=1024)
    ours, file, host, none = (env.config(b, shape) for b in ("ours", "file", "host", "none"))
    assert ours.route == "simm" and ours.extra_config["manager_address"] == "local://t-ours"
    assert file.route == "file" and file.extra_config == {"file_storage_path": str(tmp_path / "f")}
    assert host.route is None and host.hierarchical_cache
    assert not none.hierarchical_cache
    for c in (ours, file, host, none):
        assert (c.max_total_tokens, c.sleep_on_idle, c.enable_metrics) == (1024, True, True)
    if not env.mooncake.available:
        with pytest.raises(RuntimeError, match="Mooncake is not available"):
            env.config("mooncake", shape)
    with pytest.raises(ValueError, match="unknown backend 'x'; known: ours, ours-events, ours-events-stalled, file"):
        env.config("x", shape)


def test_the_event_servers_each_get_a_store_and_a_stream_of_their_own(tmp_path):
    from sglang_simm.config import SiMMConfig

    env = Environment(tag="t", root=str(tmp_path), tap_dir=str(tmp_path / "tap"),
                      mooncake=mooncake_status(sys.executable), file_dir=str(tmp_path / "f"))
    shape = Shape(model_path="m", device_tokens=1024)
    ours, reading, stalled = (env.config(b, shape) for b in ("ours", "ours-events", "ours-events-stalled"))
    stores = {c.extra_config["manager_address"] for c in (ours, reading, stalled)}
    assert len(stores) == 3 and "kv_events" not in ours.extra_config
    streams = [SiMMConfig.from_mapping(c.extra_config).kv_events for c in (reading, stalled)]
    assert all(k.enabled for k in streams) and streams[0].endpoint != streams[1].endpoint
    assert streams[1].hwm < streams[0].hwm
    # the restarted server publishes where its subscriber listens
    assert env.config("ours-events", shape).extra_config["kv_events"] == reading.extra_config["kv_events"]


def test_mooncake_standalone_attaches_to_a_client_process_that_holds_the_segment(tmp_path):
    env = Environment(tag="t", root=str(tmp_path), tap_dir=str(tmp_path / "tap"),
                      mooncake=mooncake_status(sys.executable), file_dir=str(tmp_path / "f"))
    shape = Shape(model_path="m", device_tokens=1024, l3_bytes=3 << 30)
    assert not env.available("mooncake-standalone") and env.available("ours")
    env.standalone_why = "no mooncake_client binary"
    with pytest.raises(RuntimeError, match="standalone client is not available: no mooncake_client binary"):
        env.config("mooncake-standalone", shape)
    env.master = MooncakeMaster("/bin/mooncake_master", str(tmp_path / "m.log"))
    env.master.port = 5001
    env.client = MooncakeClient("/bin/mooncake_client", str(tmp_path / "c.log"), master=env.master.address,
                                segment_bytes=shape.l3_bytes)
    env.client.port = 5002
    assert env.available("mooncake-standalone") and env.available("mooncake")
    c = env.config("mooncake-standalone", shape)
    assert c.route == "mooncake" and c.extra_config["standalone_storage"] is True
    assert c.extra_config["client_server_address"] == "127.0.0.1:5002"
    assert c.extra_config["global_segment_size"] == 0  # the segment is the client process's
    args = env.client.args()
    assert "--host=127.0.0.1" in args and "--port=5002" in args and "--master_server_address=127.0.0.1:5001" in args
    assert f"--global_segment_size={3 << 30}" in args
    inside = env.config("mooncake", shape)
    assert inside.extra_config["global_segment_size"] == 3 << 30 and "standalone_storage" not in inside.extra_config


def test_mooncake_missing_names_the_install_line():
    status = mooncake_status(sys.executable)
    if status.available:
        pytest.skip("Mooncake imports here")
    assert not status.available and MOONCAKE_INSTALL in status.why and "mooncake.store" in status.why


def test_plan_errors_name_the_flag():
    with pytest.raises(ValueError, match="--backends takes a comma list of ours, ours-events, ours-events-stalled, file"):
        plan_from_args(argparse.Namespace(backends="ours,redis"))
    with pytest.raises(ValueError, match="--repeat must be >= 1"):
        plan_from_args(argparse.Namespace(repeat=0))
    with pytest.raises(ValueError, match="--preset must be one of"):
        plan_from_args(argparse.Namespace(preset="gpt-5"))
    quick = plan_from_args(argparse.Namespace(quick=True))
    assert quick.backends == ["ours", "file"] and quick.repeat == 1 and quick.preset == "llama-tiny"
    for bad in (1.0, 0.5, 100.0):
        with pytest.raises(ValueError, match="--host-ratio must be above 1"):
            plan_from_args(argparse.Namespace(small=True, host_ratio=bad))
    small = plan_from_args(argparse.Namespace(small=True, host_ratio=1.25))
    assert small.hicache_ratio == 1.25 and small.device_tokens == 2048
    assert plan_from_args(argparse.Namespace(small=True)).hicache_ratio == 2.5


# -- workloads --------------------------------------------------------------------------


def test_conversations_grow_by_a_turn_and_are_the_same_for_every_backend():
    w = Workload(clients=3, rounds=3, turn_tokens=10, answer_tokens=4)
    rounds = conversation_prompts(w, seed=7, vocab=100)
    assert rounds == conversation_prompts(w, seed=7, vocab=100)
    assert rounds != conversation_prompts(w, seed=8, vocab=100)
    for c in range(3):
        assert [len(r[c]) for r in rounds] == [10, 24, 38]
        assert rounds[2][c][: len(rounds[1][c])] == rounds[1][c]  # a history only grows
    assert all(3 <= t < 100 for r in rounds for p in r for t in p)


def test_order_rotates_every_repetition():
    names = ["ours", "file", "mooncake"]
    assert [rotated(names, r)[0] for r in range(4)] == ["ours", "file", "mooncake", "ours"]


def test_matchable_prefix_is_whole_pages_short_of_the_last_token():
    assert matchable(3056, 16) == 3040 and matchable(3057, 16) == 3056 and matchable(16, 16) == 0


def test_turn_answers_are_compared_round_by_round():
    rep = lambda *ids: {"rounds": [{"output_ids": [list(i) for i in ids]}]}  # noqa: E731
    got = compare_turns({"none": [rep([1], [2])], "ours": [rep([1], [3])]}, "none")
    assert got == {"none": {"same": 2, "of": 2}, "ours": {"same": 1, "of": 2}}


def _long(name, storage, expected, ok=True):
    reqs = [{"label": "scratch", "ok": True, "cached": {"storage": 0}},
            {"label": "after traffic", "ok": ok, "cached": {"storage": 0}},
            {"label": "after flush", "ok": True, "cached": {"storage": storage}}]
    return {name: [{"requests": reqs, "expected_prefix": expected}]}


def test_checks_fail_on_a_missed_l3_read_or_a_different_answer():
    base = {"multi_turn_answers": {}, "restart": {}, "answers_vs": "none"}
    assert checks({**base, "long_prompt": _long("ours", 496, 496)})["ok"]
    assert checks({**base, "long_prompt": _long("host", 0, 496)})["ok"]  # no L3: recomputed
    bad = checks({**base, "long_prompt": _long("file", 480, 496)})
    assert not bad["ok"] and "480 tokens from L3, expected 496" in bad["failures"][0]
    assert not checks({**base, "long_prompt": _long("ours", 496, 496, ok=False)})["ok"]
    down = checks({**base, "long_prompt": {}, "failed": {"mooncake": "mooncake exited with status 1\nlog"}})
    assert down["failures"] == ["mooncake did not start: mooncake exited with status 1"]


def test_a_server_that_did_not_start_is_reported_by_its_last_exception():
    tail = ("he\n    tree_cache = create_tree_cache(tree_context)\n  File \"x.py\", line 3, in f\n"
            "RuntimeError: Failed to register buffer to Mooncake Store, error code: -1\n\n"
            "I1202 dummy_client.cpp:604] [unregister_shm] client_id=1\n")
    assert _error_line(tail) == "RuntimeError: Failed to register buffer to Mooncake Store, error code: -1"
    assert _error_line("x exited with status -9 while starting; log x.log:\nkilled\n").startswith("x exited")
    assert _error_line("") == "no output"
    long = _failure(RuntimeError("ours exited with status 1 while starting; log a.log:\n" + "x" * 5000 + "\nOSError: no"))
    assert long.startswith("ours exited with status 1") and long.endswith("OSError: no") and len(long) < 3100


def test_checks_fail_on_backups_that_never_landed_and_on_restart_misses():
    base = {"multi_turn_answers": {}, "answers_vs": "none", "long_prompt": {}}
    late = _long("ours", 496, 496)
    late["ours"][0]["backed_up"] = False
    got = checks({**base, "long_prompt": late, "restart": {}})
    assert not got["ok"] and "did not all reach L3 within 60 s" in got["failures"][0]
    restart = {"ours": {"prompts": 2, "l3_hits": 1, "same_answers": 2, "backed_up": True},
               "file": {"prompts": 2, "l3_hits": 2, "same_answers": 2, "backed_up": False},
               # Mooncake's segment lives in the server: a restart loses it, by design
               "mooncake": {"prompts": 2, "l3_hits": 0, "same_answers": 2, "backed_up": True}}
    got = checks({**base, "restart": restart})
    assert got["failures"] == ["ours: 1 of 2 prompts were not served from L3 after the restart",
                               "file: the restart's prompts did not all reach L3 within 60 s before the stop"]


def test_the_bench_holds_ours_store_so_no_idle_exit_empties_it_between_runs(tmp_path):
    """Between the first servers' stop and the restarted servers' start ours'
    store has no server as a client; a store with no client exits after its
    idle time with its objects. The bench's own connection keeps it."""
    from sglang_simm.local_store._handle import StoreHandle, StoreUnreachable, wait_gone

    env = Environment.create(sys.executable, want_mooncake=False, workdir=str(tmp_path))
    try:
        env.hold_store(Shape(model_path="m", l3_bytes=16 << 20), idle_exit_s=0.3)
        held = env.held[env.ours_store]
        probe = StoreHandle(env.ours_store, capacity=1, spawn=False)
        time.sleep(1.5)  # five idle times with no other client
        assert probe.status()["pid"] == held.pid  # still there, the same process
        probe.close()
        pid = held.pid
        held.close()  # the bench gone: the idle exit frees the store
        assert wait_gone(held.paths, pid, 30.0)
        with pytest.raises(StoreUnreachable):
            StoreHandle(env.ours_store, capacity=1, spawn=False).status()
    finally:
        env.close()


def test_goal_is_ours_over_mooncake_per_batch_size():
    per_op = {"ours": {"get": {"1-8": {"median": 4.0}}, "set": {"9-32": {"median": 1.0}}},
              "mooncake": {"get": {"1-8": {"median": 1.0}}, "set": {"9-32": {"median": 1.0}}}}
    rows = {(g["op"], g["pages"]): g for g in goals(per_op)}
    assert rows[("get", "1-8")]["ratio"] == 4.0 and rows[("get", "1-8")]["met"]
    assert not rows[("set", "9-32")]["met"]
    per_op["mooncake-standalone"] = {"get": {"1-8": {"median": 2.5}}}
    rows = {(g["against"], g["op"], g["pages"]): g for g in goals(per_op)}
    assert rows[("mooncake-standalone", "get", "1-8")]["ratio"] == 1.6
    assert not rows[("mooncake-standalone", "get", "1-8")]["met"] and rows[("mooncake", "get", "1-8")]["met"]
    assert ("mooncake-standalone", "set", "9-32") not in rows  # not measured there: no row


# -- /metrics histograms ------------------------------------------------------------------

METRICS = """\
# HELP sglang:backup_bandwidth Histogram
# TYPE sglang:backup_bandwidth histogram
sglang:backup_bandwidth_bucket{le="0.1",model_name="m",tp_rank="0"} 0.0
sglang:backup_bandwidth_bucket{le="0.5",model_name="m",tp_rank="0"} 2.0
sglang:backup_bandwidth_bucket{le="1.0",model_name="m",tp_rank="0"} 6.0
sglang:backup_bandwidth_bucket{le="5.0",model_name="m",tp_rank="0"} 10.0
sglang:backup_bandwidth_bucket{le="+Inf",model_name="m",tp_rank="0"} 10.0
sglang:backup_bandwidth_count{model_name="m",tp_rank="0"} 10.0
sglang:backup_bandwidth_sum{model_name="m",tp_rank="0"} 12.0
sglang:prefetch_bandwidth_bucket{le="+Inf",model_name="m",tp_rank="0"} 0.0
"""


def test_histogram_quantiles_interpolate_inside_the_bucket():
    cum = server_metrics.buckets(METRICS, "sglang:backup_bandwidth")
    assert cum[0] == (0.1, 0.0) and cum[-1][1] == 10.0
    assert server_metrics.quantile(0.5, cum) == pytest.approx(0.5 + 0.5 * (5 - 2) / 4)
    assert server_metrics.quantile(0.1, cum) == pytest.approx(0.1 + 0.4 * 1 / 2)
    assert server_metrics.quantile(0.9, cum) == pytest.approx(1.0 + 4.0 * 3 / 4)
    s = server_metrics.summary(METRICS)
    assert s["sglang:backup_bandwidth"]["n"] == 10 and s["sglang:prefetch_bandwidth"] is None


def test_histograms_sum_over_ranks():
    two = METRICS + METRICS.replace('tp_rank="0"', 'tp_rank="1"')
    assert server_metrics.buckets(two, "sglang:backup_bandwidth")[-1][1] == 20.0


# -- docs --------------------------------------------------------------------------------


def test_docs_keep_only_the_latest_result_of_each_bench(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## The server bench\n\nWhat it measures.\n\n## The copy ceiling\n\nBy hand.\n")
    write_docs_section(str(path), "server", "first run", commit="abc1234", today=datetime.date(2026, 1, 2))
    write_docs_section(str(path), "other", "other bench", commit="abc1234")
    write_docs_section(str(path), "server", "second run\n", commit="def5678", today=datetime.date(2026, 1, 3))
    text = path.read_text()
    assert "first run" not in text and "abc1234`, 2026-01-02" not in text
    assert text.count("<!-- bench:server latest -->") == 1 and text.count("<!-- /bench:server -->") == 1
    assert "Latest result: commit `def5678`, 2026-01-03.\n\nsecond run\n<!-- /bench:server -->" in text
    assert text.startswith("# Benchmarks\n\n## The server bench\n\nWhat it measures.") and "By hand." in text
    assert "other bench" in text


def test_docs_need_the_page_and_a_whole_section(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_docs_section(str(tmp_path / "missing.md"), "server", "x", commit="abc1234")
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n<!-- bench:server latest -->\nno end\n")
    with pytest.raises(ValueError, match="no '<!-- /bench:server -->'"):
        write_docs_section(str(path), "server", "x", commit="abc1234")


# -- the tap, on SGLang's real factory and file backend ----------------------------------


class _Operation:
    request_id = "bench-tap"

    def is_terminated(self) -> bool:
        return False


@pytest.fixture
def tapped_controller(monkeypatch):
    """SGLang's HiCacheController class with the tap's timing installed (undone after)."""
    pytest.importorskip("sglang")
    from sglang.srt.managers import cache_controller

    cls = cache_controller.HiCacheController
    for name, _, _ in server_tap.BATCH_FUNCTIONS:
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setattr(cls, "_sglang_simm_tapped", False, raising=False)
    server_tap.install()  # the module is imported already: patches at once
    return cls


@pytest.mark.parametrize("route", ["file", "simm"])
def test_tap_times_every_batch_of_a_real_backend_through_the_controllers_own_code(
        route, tapped_controller, tmp_path, monkeypatch):
    """The controller's own batch functions (generic for ``file``, zero-copy
    for ours) run on a real host pool and backend; each batch gives one line
    with its pages, the pages that succeeded and the pool's page bytes."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_simm.plugin import register
    from sglang_simm_dev.bench.pages import fill_pool, host_indices, page_keys
    from sglang_simm_dev.pools import PRESETS, build_host_pool, storage_config

    monkeypatch.setenv(server_tap.TAP_ENV, str(tmp_path / "tap"))
    geom = PRESETS["tiny"]
    pool = build_host_pool(geom, tokens=8 * geom.page_size)
    fill_pool(pool)
    extra = ({"file_storage_path": str(tmp_path / "files")} if route == "file"
             else {"manager_address": f"local://tap-{os.getpid()}"})
    if route == "simm":
        assert register()
    backend = StorageBackendFactory.create_backend(route, storage_config(extra_config=extra), pool)
    backend.register_mem_pool_host(pool)
    zero_copy = route == "simm"
    get = tapped_controller._page_get_zero_copy if zero_copy else tapped_controller._generic_page_get
    put = tapped_controller._page_set_zero_copy if zero_copy else tapped_controller._generic_page_set
    controller = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                                 page_size=geom.page_size)
    keys = page_keys(4, f"tap-{route}")
    try:
        assert put(controller, keys, host_indices(range(4), geom.page_size))
        wanted = keys[:2] + page_keys(1, "missing")
        assert get(controller, _Operation(), wanted, host_indices(range(4, 7), geom.page_size)) == 2
    finally:
        backend.close() if hasattr(backend, "close") else None
    ops = server_tap.read_ops(tmp_path / "tap")
    assert [(o.op, o.pages, o.ok) for o in ops] == [("set", 4, 4), ("get", 3, 2)]
    pool_bytes = pool.get_size_per_token() * pool.page_size
    assert pool_bytes == geom.page_bytes() and all(o.page_bytes == pool_bytes and o.seconds > 0 for o in ops)
    assert ops[1].gib_per_s == pytest.approx(2 * pool_bytes / 2**30 / ops[1].seconds)
    dist = server_tap.by_size(ops)
    assert dist["get"]["1-8"]["n"] == 1 and dist["set"]["1-8"]["n"] == 1


def test_patches_apply_to_modules_imported_after_install(monkeypatch, tmp_path):
    seen = []
    name = "_sglang_simm_test_late_module"
    monkeypatch.setattr(server_tap, "_PATCHES", {name: seen.append})
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    server_tap.install()
    assert not seen
    import importlib

    folder = str(tmp_path)  # pytest's: nothing is left behind
    with open(os.path.join(folder, f"{name}.py"), "w") as f:
        f.write("VALUE = 1\n")
    monkeypatch.syspath_prepend(folder)
    module = importlib.import_module(name)
    try:
        assert seen == [module] and module.VALUE == 1
        assert not any(type(f).__name__ == "_Finder" for f in sys.meta_path)  # gone once done
    finally:
        sys.modules.pop(name, None)


def test_host_memory_reserve_is_lowered_only_when_asked(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.pool_host import base

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 10 << 30)
    monkeypatch.delenv(server_tap.RESERVE_ENV, raising=False)
    server_tap._patch_host_reserve(base)
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 10 << 30
    monkeypatch.setenv(server_tap.RESERVE_ENV, str(1 << 30))
    before = base.host_memory_budget_bytes()
    server_tap._patch_host_reserve(base)
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1 << 30
    assert base.host_memory_budget_bytes() > before  # what SGLang sizes the pool against


def test_tap_sitecustomize_loads_the_tap_from_its_file(tmp_path):
    folder = server_tap.write_tap(tmp_path / "site")
    text = open(os.path.join(folder, "sitecustomize.py")).read()
    assert os.path.abspath(server_tap.__file__) in text and server_tap.TAP_ENV in text
    compile(text, "sitecustomize.py", "exec")


def test_a_torn_line_is_skipped(tmp_path):
    line = {"op": "get", "pages": 3, "ok": 3, "seconds": 0.5, "page_bytes": 1 << 20, "t": 1.0}
    (tmp_path / "1.jsonl").write_text(json.dumps(line) + "\n" + '{"op": "se')
    ops = server_tap.read_ops(tmp_path)
    assert len(ops) == 1 and ops[0].gib_per_s == pytest.approx(3 / 1024 / 0.5)
    assert server_tap.size_class(8) == "1-8" and server_tap.size_class(9) == "9-32"
    assert server_tap.size_class(200) == ">128"


# -- the whole harness, tiny ----------------------------------------------------------------


@pytest.mark.e2e
def test_quick_bench_on_file_and_ours(tmp_path):
    """Two real servers (the tiny model), one repetition, every workload and
    a restart: the answers check out, both L3 backends serve the flushed
    prompt and the restarted server from L3, and both have timed reads and
    writes; SGLang's histograms have ours and nothing of ``file``."""
    from sglang_simm_dev.bench.server import run
    from sglang_simm_dev.bench.server_render import markdown, tables

    plan = plan_from_args(argparse.Namespace(quick=True))
    plan.workdir = str(tmp_path / "work")
    plan.model_dir = str(tmp_path / "model")
    result = run(plan)
    assert result["checks"]["ok"], result["checks"]["failures"]
    for name in ("ours", "file"):
        long = result["long_prompt"][name][0]
        flushed = long["requests"][-1]
        assert flushed["cached"]["storage"] == long["expected_prefix"] > 0
        # backups went on while the scheduler slept (--sleep-on-idle): the
        # bench waited for them with no request in flight
        assert long["backed_up"] and long["backup_s"] is not None
        assert result["restart"][name]["backed_up"]
        assert result["restart"][name]["l3_hits"] == result["restart"][name]["prompts"] == 2
        assert result["restart"][name]["same_answers"] == 2
        assert set(result["per_op"][name]) == {"get", "set"}
        calls = result["calls"][name]  # every call, as the distributions were made from
        for op in ("get", "set"):
            moved = [c for c in calls if c[0] == op and c[2]]
            assert len(moved) == sum(d["n"] for d in result["per_op"][name][op].values())
            assert all(0 < c[2] <= c[1] and c[3] > 0 for c in moved)
        rounds = result["multi_turn"][name][0]["rounds"]
        assert rounds[0]["hit_rate"] == 0 and rounds[1]["hit_rate"] > 0
        itl = result["itl"][name][0]  # decoders streamed while the background went through L3
        assert itl["l3_tokens"] == itl["expected_l3_tokens"] > 0
        assert all(len(d["times_s"]) > 1 and d["counts"][-1] == plan.workload.itl_answer_tokens
                   for d in itl["decoders"])
        assert result["summary"][name]["itl"]["under"]["tokens"] > 0
    assert result["histograms"]["ours"]["sglang:backup_bandwidth"]["n"] > 0
    assert result["histograms"]["file"]["sglang:backup_bandwidth"] is None
    assert [t[0] for t in tables(result)][:2] and "| backend |" in markdown(result, "bench --server --quick")
    json.dumps(result, default=str)


# -- a small backup, layer by layer --------------------------------------------------------


def test_self_times_take_each_inner_layer_out_of_its_caller():
    from sglang_simm_dev.bench.server_backup import Overhead, self_times

    totals = {"batch": 100_000, "mput": 80_000, "put_from": 70_000, "put": 20_000, "copy": 30_000, "commit": 10_000}
    got = self_times(totals)
    assert got == {"backend": 20.0, "client": 10.0, "handle": 10.0, "put": 20.0, "populate": 0.0, "copy": 30.0,
                   "commit": 10.0, "total": 100.0}
    # each timer costs 1 µs inside its window and 2 µs in its caller's
    got = self_times(totals, {k: 1 for k in totals}, Overhead(inside=1.0, outside=2.0))
    assert got == {"backend": 17.0, "client": 7.0, "handle": 3.0, "put": 19.0, "populate": 0.0, "copy": 29.0,
                   "commit": 9.0, "total": 84.0}


def test_backup_breakdown_reaches_every_layer_of_a_real_backup():
    """Our backend on a local store (its own process) and a real host pool:
    every layer's timer saw the call and the copy took time (``measure``
    raises unless every backup stored all its pages): a PUT and a COMMIT
    round trip each."""
    pytest.importorskip("sglang")
    from sglang_simm_dev.bench.server_backup import LAYERS, measure, render

    result = measure([1, 4], repeat=3, warmup=1)
    for n in ("1", "4"):
        layers = result["sizes"][n]["layers"]
        assert set(layers) == {*LAYERS, "total"}
        assert all(layers[k]["median"] > 0 for k in ("backend", "client", "handle", "put", "copy", "commit"))
        assert result["sizes"][n]["cpu"]["total"]["median"] <= layers["total"]["median"] * 1.05 + 50
    assert result["ping_us"]["median"] > 0
    assert "| commit |" in render(result)


# -- decoders under L3 traffic ------------------------------------------------------------


def _sse(*chunks):
    lines = []
    for c in chunks:
        lines += [b"data: " + json.dumps(c).encode() + b"\n", b"\n"]
    return lines + [b"data: [DONE]\n"]


def test_a_stream_is_timed_chunk_by_chunk_and_a_chunk_without_a_new_token_is_no_token():
    from sglang_simm_dev.bench.server_itl import read_stream

    meta = lambda n: {"completion_tokens": n, "prompt_tokens": 5,  # noqa: E731
                      "cached_tokens_details": {"device": 0, "host": 0, "storage": 3}}
    body = _sse({"output_ids": [7], "meta_info": meta(1)}, {"output_ids": [7, 8], "meta_info": meta(2)},
                {"output_ids": [7, 8, 9, 4], "meta_info": meta(4)}, {"output_ids": [7, 8, 9, 4], "meta_info": meta(4)})
    clock = iter([10.1, 10.3, 10.9, 11.0]).__next__
    seen = []
    s = read_stream(body, started=10.0, clock=clock, on_tokens=seen.append)
    assert s.times == pytest.approx([0.1, 0.3, 0.9]) and s.counts == [1, 2, 4] and seen == [1, 2, 4]
    assert s.output_ids == [7, 8, 9, 4] and s.prompt_tokens == 5 and s.cached["storage"] == 3
    with pytest.raises(Exception, match="an error"):
        read_stream(_sse({"error": {"message": "bad"}}), started=0.0)


def test_inter_token_latency_spreads_a_chunk_over_its_tokens_and_splits_on_the_window():
    from sglang_simm_dev.bench.server_itl import Stream, against, itl_stats, percentile, pooled, split

    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([5], 0.99) == 5 and percentile([], 0.5) is None
    s = Stream(started=100.0, times=[0.0, 0.1, 0.2, 0.8, 0.9], counts=[1, 2, 3, 5, 6])
    parts = split([s], (100.15, 100.85))  # the gaps ending at 0.2 and 0.8 are under the window
    assert parts["under"][0] == pytest.approx([0.1, 0.3, 0.3]) and parts["under"][1] == pytest.approx([0.1, 0.6])
    assert parts["quiet"][0] == pytest.approx([0.1, 0.1]) and parts["prefill"] == ([], [])
    # a background prefill's first token inside the long gap (or just after its end): a prefill, not a decode step
    parts = split([s], (100.15, 100.85), prefills=[100.5], slack=0.02)
    assert parts["prefill"][1] == pytest.approx([0.6]) and parts["under"][1] == pytest.approx([0.1])
    # read just after the decoders' next token: both gaps may hold it
    assert split([s], (100.15, 100.85), prefills=[100.81], slack=0.02)["prefill"][1] == pytest.approx([0.6, 0.1])
    assert split([s], (100.15, 100.85), prefills=[100.83], slack=0.02)["prefill"][1] == pytest.approx([0.1])
    # before every decoder had its first token: another decoder's prefill, none of the sides
    parts = split([s], (100.15, 100.85), steady_from=100.1, slack=0.0)
    assert parts["quiet"][0] == pytest.approx([0.1]) and parts["under"][1] == pytest.approx([0.1, 0.6])
    st = itl_stats(*parts["under"])
    assert st["tokens"] == 3 and st["max"] == pytest.approx(0.6) and st["p50"] == pytest.approx(0.3)
    rep = {"window_s": 0.7, "covered": 1.0, "l3_tokens": 0, "expected_l3_tokens": 0, "background": [],
           "decoders": [{"window_offset_s": 0.15, "times_s": s.times, "counts": s.counts}]}
    assert pooled([rep, rep])["under"]["tokens"] == 6
    rep["background"] = [{"first_token_s": 0.5}]  # seconds after the window's start: 0.65 in the stream's clock
    assert pooled([rep])["prefill"]["tokens"] == 2 and pooled([rep])["under"]["tokens"] == 1
    ratios = against({"none": {"under": {"p50": 0.1, "p99": 0.2, "max": 0.4}},
                      "ours": {"under": {"p50": 0.1, "p99": 0.21, "max": 0.2}}}, "none")
    assert ratios["ours"]["p99"] == pytest.approx(1.05) and ratios["none"]["p99"] == 1.0


def test_every_backend_gets_the_same_seeded_background():
    from sglang_simm_dev.bench.server_itl import prompts

    w = Workload(itl_decoders=2, itl_prompt_tokens=8, itl_stored=3, itl_fresh=2, itl_bg_tokens=20)
    p = prompts(w, seed=3, vocab=100)
    assert p == prompts(w, seed=3, vocab=100) and p != prompts(w, seed=4, vocab=100)
    assert [len(x) for x in p["decoders"]] == [8, 8] and len(p["stored"]) == 3 and len(p["fresh"]) == 2
    assert sorted(p["order"]) == [("fresh", 0), ("fresh", 1), ("stored", 0), ("stored", 1), ("stored", 2)]


def test_workloads_are_chosen_by_name():
    plan = plan_from_args(argparse.Namespace(quick=True, workloads="itl"))
    assert plan.workloads == ("itl",) and not plan.restart
    assert plan_from_args(argparse.Namespace(workloads="restart,long")).workloads == ("long", "restart")
    with pytest.raises(ValueError, match="--workloads takes a comma list of long, turns, itl, restart"):
        plan_from_args(argparse.Namespace(workloads="itl,x"))


@pytest.mark.e2e
def test_decoders_under_l3_traffic_against_no_hicache(tmp_path):
    """The inter-token latency workload alone, ours and no HiCache: streamed
    token times for every decoder, the window's tokens counted, ours' p99
    over none's in the JSON, the table and the goal line."""
    from sglang_simm_dev.bench.server import run
    from sglang_simm_dev.bench.server_render import markdown, notes, tables

    plan = plan_from_args(argparse.Namespace(quick=True, workloads="itl", backends="ours,none"))
    plan.workdir = str(tmp_path / "work")
    plan.model_dir = str(tmp_path / "model")
    result = run(plan)
    assert result["checks"]["ok"], result["checks"]["failures"]
    assert set(result["itl"]) == {"ours", "none"} and not result["long_prompt"]["ours"] and not result["restart"]
    w = plan.workload
    for name in ("ours", "none"):
        rep = result["itl"][name][0]
        assert len(rep["decoders"]) == w.itl_decoders and rep["window_s"] > 0
        for d in rep["decoders"]:
            assert d["counts"][-1] == w.itl_answer_tokens and d["times_s"] == sorted(d["times_s"])
        assert [b["kind"] for b in rep["background"]].count("stored") == w.itl_stored
        s = result["summary"][name]["itl"]
        assert s["under"]["tokens"] > 0 and 0 < s["under"]["p50"] <= s["under"]["p99"] <= s["under"]["max"]
    assert result["itl"]["ours"][0]["l3_tokens"] == result["itl"]["ours"][0]["expected_l3_tokens"] > 0
    assert result["itl"]["none"][0]["l3_tokens"] == 0
    assert result["itl_vs"] == "none" and result["itl_ratios"]["none"]["p99"] == 1.0
    assert result["itl_ratios"]["ours"]["p99"] > 0
    titles = [t[0] for t in tables(result)]
    assert any(t.startswith("Decoders under L3 traffic") for t in titles)
    assert not any("Long prompt" in t for t in titles)
    assert any("p99 inter-token latency under L3 traffic: ours" in line for line in notes(result))
    assert "| p99 |" in markdown(result, "bench --server --quick --workloads itl")
    json.dumps(result, default=str)
