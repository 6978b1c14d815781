"""What scripts/compat.sh and tests/test_compat.py count as a pass
(``compat_probe.failures``), and the requirements it derives for a release
with no file of its own (scripts/_compat_reqs.py). Pure: no other venv."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sglang_simm_dev.compat_probe import failures

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"cls": "sglang_simm.backend.HiCacheSiMM", "set": [True] * 3, "exists": 3, "get": [True] * 3,
        "bytes_equal": True, "metrics": "sglang.srt.metrics.collector.StorageMetrics"}
GOOD_V2 = {"set": [True] * 3, "exists": 3, "get": [True] * 3, "bytes_equal": True}


def result(release, routes, **cases):
    out = {"sglang": release, "package": "x/site-packages/sglang_simm/__init__.py", "routes": routes}
    for route in routes:
        out[f"{route}-mha"] = dict(GOOD)
        out[f"{route}-mla"] = dict(GOOD)
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
