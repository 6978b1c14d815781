"""Older SGLang releases, each in its own virtual environment (scripts/test.sh
builds them and names their pythons in SGLANG_SIMM_COMPAT_PYTHONS): the
dynamic route builds the backend and pages round-trip; where the release has
plugins, SGLang's loader resolves ``simm`` to this package."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

PYTHONS = os.environ.get("SGLANG_SIMM_COMPAT_PYTHONS", "").split()

PROBE = r'''
import json, torch
from importlib.metadata import version
from sglang_simm.tools.pools import PRESETS, build_host_pool, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
import sglang_simm

result = {"sglang": version("sglang"), "package": sglang_simm.__file__}
routes = ["dynamic"]
try:
    from sglang.srt.plugins import load_plugins
    load_plugins()
    routes.append("simm")
except ImportError:
    pass
for route in routes:
    for name in ("tiny", "mla"):
        if name == "mla":
            from sglang_simm.tools.pools import ModelGeometry
            geom = ModelGeometry("tiny-mla", 2, 1, 48, 4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16)
        else:
            geom = PRESETS["tiny"]
        host = build_host_pool(geom, tokens=64)
        # one host store per release: stores outlive their clients, and every
        # release's probe writes the same keys with its own random bytes
        extra = {"manager_address": f"local://compat-{result['sglang']}-{route}-{name}"}
        if route == "dynamic":
            extra.update(backend_name="simm", module_path="sglang_simm", class_name="HiCacheSiMM", interface_v1=1)
        cfg = storage_config(extra_config=extra, is_mla_model=geom.is_mla)
        backend = StorageBackendFactory.create_backend(route, cfg, host)
        backend.register_mem_pool_host(host)
        buf = host.kv_buffer.view(-1).view(torch.uint8)
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
        ps = host.page_size
        want = [host.get_data_page(p * ps, flat=True).contiguous().view(torch.uint8).clone() for p in range(3)]
        keys = [f"{i:064x}" for i in range(3)]
        ok_set = backend.batch_set_v1(keys, torch.arange(0, 3 * ps))
        n_exist = backend.batch_exists(keys)
        ok_get = backend.batch_get_v1(keys, torch.arange(4 * ps, 7 * ps))
        same = all(torch.equal(host.get_data_page((4 + p) * ps, flat=True).contiguous().view(torch.uint8), want[p]) for p in range(3))
        stats = backend.get_stats()
        result[f"{route}-{name}"] = {
            "cls": f"{type(backend).__module__}.{type(backend).__name__}",
            "set": ok_set, "exists": n_exist, "get": ok_get, "bytes_equal": same,
            "metrics": type(stats).__module__ + "." + type(stats).__name__,
        }
        backend.close()
print(json.dumps(result))
'''


@pytest.mark.skipif(not PYTHONS, reason="SGLANG_SIMM_COMPAT_PYTHONS is not set (scripts/test.sh sets it)")
@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: p.split("/")[-3] if p.count("/") > 2 else p)
def test_older_release_round_trips_pages_through_sglangs_factory(python):
    out = subprocess.run([python, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "site-packages" in result["package"], "the compat venv must run the installed wheel"
    for route_case, r in ((k, v) for k, v in result.items() if isinstance(v, dict)):
        assert r["cls"] == "sglang_simm.backend.HiCacheSiMM", route_case
        assert r["set"] == [True] * 3 and r["exists"] == 3 and r["get"] == [True] * 3, route_case
        assert r["bytes_equal"], route_case
        assert r["metrics"].endswith("StorageMetrics"), route_case
    assert "dynamic-tiny" in result and "dynamic-mla" in result
    release = tuple(int(x) for x in result["sglang"].split(".")[:3])
    if release >= (0, 5, 11):  # plugin entry points: load_plugins() made `simm` ours
        assert "simm-tiny" in result and "simm-mla" in result
