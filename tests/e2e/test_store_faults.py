"""A failing L3 costs serving nothing and heals itself (issue #29), on real
CPU servers: two launched side by side for this file.

* ``faults``: its local store up, hung (SIGSTOP), resumed and killed
  (kill -9) under requests (``store_scenario.run``): every output is the
  same as a fresh computation, the server logs no traceback, the breaker's
  transitions are in its log, and the L3-resident prompt is restored from
  L3 again after the resume and after the kill (by a store process a probe
  started, which took the published pages over).
* ``injected``: SGLang 0.5.23's own failure injector
  (``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` / ``..._RANDOM_FAILURE``,
  wrapped around the backend by its storage factory): the same prompts give
  the same outputs as on ``faults`` while its store was up.

Behaviour only: the latencies are printed (and written next to the
server's log as ``figures.json``), never asserted.
"""

from __future__ import annotations

import json
import os

import pytest
from e2e_util import PAGE, matchable_tokens, prompt

import store_scenario
from sglang_simm_dev.sglang_server import SGLangServer

pytestmark = pytest.mark.e2e

INJECTOR_ENV = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.05",
                "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3"}


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("store-faults")
    servers = {
        "faults": SGLangServer(store_scenario.server_config(tiny_llama, "e2e-faults"), root / "faults",
                               name="faults"),
        "injected": SGLangServer(store_scenario.server_config(tiny_llama, "e2e-injected", env=INJECTOR_ENV),
                                 root / "injected", name="injected"),
    }
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def scenario(pair):
    server = pair["faults"]
    seen = store_scenario.run(server)
    refs = store_scenario.references(server, seen)
    figures = seen.figures()
    print("\nissue #29 scenario (breaker on):", json.dumps(figures))
    with open(os.path.join(server.workdir, "figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return server, seen, refs


def why(server, what: str) -> str:
    return f"{what}; server log {server.log_path}:\n{server.log_tail(40)}"


def test_outputs_are_identical_throughout(scenario):
    server, seen, refs = scenario
    for phase, seed, g in seen.generations:
        want = refs[seed]
        assert g.output_ids == want.output_ids, why(server, f"{phase}: prompt {seed}: output ids differ")
        assert g.logprobs == want.logprobs, why(server, f"{phase}: prompt {seed}: logprobs differ")


def test_l3_hits_come_back_after_a_resume_and_after_a_kill(scenario):
    server, seen, _ = scenario
    want = matchable_tokens(store_scenario.LONG, PAGE)
    assert seen.resident_l3_tokens["up"] == want, why(server, f"store up: {seen.resident_l3_tokens}")
    assert seen.resident_l3_tokens["resumed"] > 0, why(server, "no L3 hit after the store resumed")
    assert seen.resident_l3_tokens["killed"] > 0, why(server, "no L3 hit after the store was killed")


def test_the_breaker_opened_and_closed_and_nothing_raised(scenario):
    server, _, _ = scenario
    log = server.log_text()
    assert "Traceback" not in log, why(server, "a traceback in the server log")
    assert "breaker open after" in log, why(server, "the breaker never opened while the store hung")
    assert "breaker closed" in log, why(server, "the breaker never closed again")
    assert log.index("breaker open after") < log.rindex("breaker closed")
    assert server.proc.poll() is None


def test_sglangs_failure_injector_leaves_outputs_unchanged(pair, scenario):
    """The injector makes a share of storage calls fail or wait before they
    reach the backend (its storage factory wraps every backend it makes)."""
    _, seen, _ = scenario
    server = pair["injected"]
    log = server.log_text()
    assert "HiCache storage test injector enabled" in log, why(server, "the injector is not on")
    without = {s: g for p, s, g in seen.generations if p == "up"}  # the faults server, store up
    for seed, want in without.items():
        ids = prompt(seed, store_scenario.LONG)
        for attempt in ("fresh", "restored"):
            if attempt == "restored":
                server.flush_cache()
            got = server.generate(ids, max_new_tokens=4)
            assert got.output_ids == want.output_ids, why(server, f"prompt {seed} ({attempt}): output ids differ")
            assert got.logprobs == want.logprobs, why(server, f"prompt {seed} ({attempt}): logprobs differ")
    log = server.log_text()
    assert "Traceback" not in log, why(server, "a traceback in the server log")
    assert server.proc.poll() is None
