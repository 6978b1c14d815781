"""What scripts/compat.sh and tests/test_compat.py count as a pass
(``compat_probe.failures``), the probe's pool stacks on this venv's SGLang
(``compat_probe.pools_case``, in this process), and the requirements it
derives for a release with no file of its own (scripts/_compat_reqs.py). No
other venv."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from pathlib import Path

import pytest

from sglang_simm_dev import compat_probe
from sglang_simm_dev.compat_probe import failures

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"cls": "sglang_simm.backend.HiCacheSiMM", "set": [True] * 3, "exists": 3, "get": [True] * 3,
        "bytes_equal": True, "metrics": "sglang.srt.metrics.collector.StorageMetrics"}
GOOD_V2 = {"set": [True] * 3, "exists": 3, "get": [True] * 3, "bytes_equal": True}
STORED = {"stored": True, "bytes_equal": True, "kv_hit": 3}
REFUSED = {"refused": "SGLang does not describe the pages of MHATokenToKVPoolMXFP8Host ..."}


def result(release, routes, pools=None, **cases):
    out = {"sglang": release, "package": "x/site-packages/sglang_simm/__init__.py", "routes": routes}
    for route in routes:
        out[f"{route}-mha"] = dict(GOOD)
        out[f"{route}-mla"] = dict(GOOD)
    out["pools"] = {"mimo-v2": dict(STORED), "deepseek-v4": dict(STORED), "mxfp8": dict(REFUSED)}
    out["pools"].update(pools or {})
    out.update(cases)
    return out


def test_a_clean_probe_passes():
    assert failures(result("0.5.8", ["dynamic"])) == []
    assert failures(result("0.5.23", ["dynamic", "simm"], **{"simm-mha-v2": dict(GOOD_V2)})) == []


def test_other_bytes_a_short_hit_or_the_in_tree_class_fail():
    assert failures(result("0.5.8", ["dynamic"], **{"dynamic-mla": {**GOOD, "bytes_equal": False}}))
    assert failures(result("0.5.8", ["dynamic"], **{"dynamic-mha": {**GOOD, "exists": 2}}))
    intree = {**GOOD, "cls": "sglang.srt.mem_cache.storage.simm.hicache_simm.HiCacheSiMM"}
    assert failures(result("0.5.11", ["dynamic", "simm"], **{"simm-mha": intree}))
    assert failures(result("0.5.23", ["dynamic", "simm"], **{"simm-mla-v2": {**GOOD_V2, "get": [True, False, True]}}))


def test_a_release_with_plugins_must_load_them():
    problems = failures(result("0.5.11", ["dynamic"]))
    assert problems and "load_plugins" in problems[0]


def test_derived_requirements_take_sglangs_pins_and_keep_torchs_family(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_compat_reqs", ROOT / "scripts" / "_compat_reqs.py")
    reqs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reqs)
    (tmp_path / "sglang-cpu-0.5.8.txt").write_text("transformers==4.57.1  # pin\ntorchvision==0.28.0\nhuggingface_hub==0.36.2\n")
    (tmp_path / "sglang-cpu-0.5.11.txt").write_text("transformers==5.6.0\neinops==0.8.2\n")
    monkeypatch.setattr(reqs, "version", lambda name: "0.5.10")
    monkeypatch.setattr(reqs, "requires", lambda name: ["transformers==4.57.9", "torchvision==0.1", "aiohttp>=3",
                                                      "einops", "flashinfer==1", "pytest==8; extra == 'test'"])
    assert reqs.base_file("0.5.10", tmp_path).name == "sglang-cpu-0.5.8.txt"
    reqs.main(str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# derived for sglang==0.5.10 from sglang-cpu-0.5.8.txt")
    # SGLang's own pin wins; torch's family stays at the venv's torch; an
    # older file's transitive pin is left to pip; what the release needs that
    # some file knows installs on a CPU is added (einops), GPU-only wheels not
    assert lines[1:] == ["transformers==4.57.9", "torchvision==0.28.0", "huggingface_hub", "einops"]


def test_a_stack_built_and_not_round_tripped_fails_and_a_skipped_one_does_not():
    skipped = {"skipped": "this SGLang (0.5.11) has no sglang.srt.mem_cache.pool_host.mha"}
    assert failures(result("0.5.11", ["dynamic", "simm"], pools={"mimo-v2": skipped, "mxfp8": skipped})) == []
    for bad in ({**STORED, "bytes_equal": False}, {**STORED, "stored": False}, {**STORED, "kv_hit": 2},
                {"error": "RuntimeError: boom"}, {"refused": "UnsupportedPoolError: ..."}):
        problems = failures(result("0.5.23", ["dynamic", "simm"], pools={"deepseek-v4": bad}))
        assert len(problems) == 1 and problems[0].startswith("pools deepseek-v4:"), problems


def test_mxfp8_must_be_refused_and_the_stacks_must_have_run():
    assert failures(result("0.5.23", ["dynamic", "simm"], pools={"mxfp8": {"accepted": True}}))
    no_pools = result("0.5.23", ["dynamic", "simm"])
    del no_pools["pools"]
    assert failures(no_pools) == ["pools: not run"]
    no_mxfp8 = result("0.5.23", ["dynamic", "simm"])
    del no_mxfp8["pools"]["mxfp8"]
    assert failures(no_mxfp8) == ["pools mxfp8: not run"]


def test_a_stack_this_release_cannot_build_is_skipped_with_the_reason(monkeypatch):
    from sglang_simm_dev import hybrid_pools

    def constructor_of_another_release(layout):
        raise TypeError("__init__() got an unexpected keyword argument 'allocator_type'")

    monkeypatch.setitem(hybrid_pools.STACKS, "mimo-v2", constructor_of_another_release)
    got = compat_probe.stack_case("dynamic", "mimo-v2", "local://never-reached")
    assert got == {"skipped": "not built: TypeError: __init__() got an unexpected keyword argument 'allocator_type'"}


@pytest.fixture
def pools_result(store_name):
    """The probe's ``pools`` over a store of the test's own, on the plugin
    route where this SGLang loads plugins (as the probe takes it)."""
    from sglang_simm.local_store import reset_servers
    from sglang_simm.plugin import register

    try:
        yield compat_probe.pools_case("simm" if register() else "dynamic", f"local://{store_name}")
    finally:
        reset_servers(store_name)


def test_every_pool_stack_this_release_builds_round_trips_through_the_probe(pools_result):
    """The probe's ``pools`` on this venv's SGLang: on 0.5.23 every stack
    is stored and read back byte for byte and MXFP8 is refused at attach;
    on an older release, whatever it builds passes."""
    from sglang_simm_dev.hybrid_pools import STACKS

    assert list(pools_result) == [*STACKS, "mxfp8"]
    assert compat_probe.stack_failures(pools_result) == []
    if tuple(int(x) for x in version("sglang").split(".")[:3]) >= (0, 5, 23):
        assert {label: r for label, r in pools_result.items() if label != "mxfp8"} == {label: STORED for label in STACKS}
        assert "--kv-cache-dtype" in pools_result["mxfp8"]["refused"]
