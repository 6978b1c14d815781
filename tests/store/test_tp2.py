"""TP = 2 for real: two processes, each SGLang's own HybridCacheController in
a gloo group of two, over the local store.

* MLA: SGLang backs pages up from rank 0 only and agrees on hits with a MIN
  all-reduce, so rank 1 must find rank 0's pages in the shared store;
* MHA: each rank stores and restores its own heads;
* control: the in-process local store (one store per rank) gives MLA no hit on
  any rank, the very failure the local store exists to fix.

The ranks' processes gone, the shared stores hold no grant of theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from polling import until
from sglang_simm.local_store._handle import StoreUnreachable, open_running, running_status

pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")

pytestmark = pytest.mark.host

RANK = os.path.join(os.path.dirname(__file__), "tp_rank.py")
PAGES = 12


def run_ranks(tmp_path, runs: list[dict]) -> list[list[dict]]:
    """Both ranks through every run; per run, the two ranks' results."""
    import sglang_simm

    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sglang_simm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    init = f"file://{tmp_path}/pg-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [sys.executable, RANK, json.dumps({"rank": r, "size": 2, "init": init, "pages": PAGES, "runs": runs})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for r in range(2)
    ]
    per_rank = []
    try:
        for proc in procs:
            # an upper bound on a hung rank, not a speed check: each rank imports
            # SGLang and runs three controllers, beside the suite's idle e2e
            # servers on two cores (seen past 300 s on a loaded machine)
            stdout, stderr = proc.communicate(timeout=1200)
            lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            assert proc.returncode == 0 and len(lines) == len(runs), (
                f"rank failed ({proc.returncode}): {stdout[-2000:]} {stderr[-4000:]}")
            per_rank.append(lines)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [list(pair) for pair in zip(*per_rank)]


@pytest.fixture(scope="module")
def shared_stores(host_store_dir):
    """The names of the two stores the ranks share (started by the ranks, in
    the session's store directory); stopped, their objects dropped, after
    the module."""
    name = f"tp2-{uuid.uuid4().hex[:8]}"
    names = {"mla": f"{name}-mla", "mha": f"{name}-mha"}
    yield names
    for store in names.values():
        try:
            handle = open_running(host_store_dir, store)
        except StoreUnreachable:
            continue
        handle.stop(discard=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory, shared_stores):
    runs = [
        {"model": "mla", "manager": f"local://{shared_stores['mla']}"},
        {"model": "mha", "manager": f"local://{shared_stores['mha']}"},
        {"model": "mla", "manager": f"inprocess://{shared_stores['mla']}-own"},
    ]
    return dict(zip(("mla", "mha", "mla-inprocess"), run_ranks(tmp_path_factory.mktemp("tp2"), runs)))


def test_mla_pages_written_by_rank_0_are_restored_on_both_ranks(results):
    r0, r1 = results["mla"]
    assert (r0["writer"], r1["writer"]) == (True, False)  # SGLang's own choice: one writer for MLA
    assert r0["pages_written"] == PAGES and r1["pages_written"] == 0
    for r in (r0, r1):
        assert r["hits"] == PAGES and r["loaded"] == PAGES, r  # after the MIN all-reduce
        assert r["mismatched"] == [], r
    assert r1["pages_read"] == PAGES  # rank 1 read rank 0's pages


def test_mha_pages_stay_per_rank(results):
    for r in results["mha"]:
        assert r["writer"] and r["pages_written"] == PAGES
        assert r["hits"] == PAGES and r["loaded"] == PAGES, r
        assert r["mismatched"] == [], r  # each rank got its own heads, not the other's


def test_an_in_process_store_per_rank_gives_mla_no_hit(results):
    r0, r1 = results["mla-inprocess"]
    assert r0["pages_written"] == PAGES
    assert (r0["hits"], r1["hits"]) == (0, 0)  # rank 1's own store is empty: MIN is 0 everywhere


@pytest.mark.parametrize("model", ["mla", "mha"])
def test_the_ranks_leave_no_grant_in_the_shared_store(results, shared_stores, host_store_dir, model):
    def settled():
        status = running_status(host_store_dir, shared_stores[model])
        return status if status["open_grants"] == status["orphaned_grants"] == 0 else None

    status = until(settled, what=f"the {model} store to end the exited ranks' grants")
    assert status["objects"] >= PAGES and status["reserved_bytes"] == 0 and status["pinned_objects"] == 0
