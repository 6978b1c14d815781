"""One SGLang release's compatibility, checked in its own interpreter.

``python -m sglang_simm_dev.compat_probe`` builds the backend through SGLang's
own storage factory on every route the release has (``dynamic`` always,
``simm`` where SGLang loads plugins), round-trips three pages of an MHA and an
MLA host pool, then the same through the v2 batch interface where the release
has it, and prints one JSON object. ``scripts/compat.sh`` and
``tests/test_compat.py`` run it in each release's virtual environment; every
case records what SGLang answered, so the caller decides what counts as a pass.

Under ``"pools"``, every host pool stack of ``hybrid_pools`` (SGLang 0.5.23's
hybrid models) the release can build, on the last route (``simm`` where the
release has it): attached and driven as SGLang's hybrid controller does, its
pages backed up, the host memory scrambled, read back into other slots and
compared (``{"stored", "bytes_equal", "kv_hit"}``); MXFP8 KV, which the
backend refuses, as ``{"refused": message}``; a stack the release lacks a
class for, or builds otherwise, as ``{"skipped": why}``.
"""

from __future__ import annotations

import json
import uuid
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any


#: The first SGLang release that loads ``sglang.srt.plugins`` entry points.
PLUGINS_SINCE = (0, 5, 11)
#: pages each pool stack round-trips (``hybrid_pools.plan``'s default)
STACK_PAGES = 3
#: the stack the backend must refuse at attach
REFUSED = "mxfp8"


def _geometries() -> dict[str, Any]:
    from sglang_simm_dev.pools import PRESETS, ModelGeometry

    return {
        "mha": PRESETS["tiny"],
        "mla": ModelGeometry("tiny-mla", 2, 1, 48, 4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16),
    }


def _pages(host: Any, first: int, count: int) -> list[Any]:
    import torch

    ps = host.page_size
    return [
        host.get_data_page((first + p) * ps, flat=True).contiguous().view(-1).view(torch.uint8).clone()
        for p in range(count)
    ]


def _backend(route: str, geom: Any) -> tuple[Any, Any]:
    from sglang_simm_dev.pools import build_host_pool, create_backend

    host = build_host_pool(geom, tokens=64)
    # a store of this case's own: every release's probe shares one store
    # directory, and the same pages would have the same keys
    address = f"local://compat-{route}-{geom.name}-{uuid.uuid4().hex[:8]}"
    backend = create_backend(route, host, manager_address=address, is_mla_model=geom.is_mla, model_name=geom.name)
    return backend, host


def _randomize(host: Any, seed: int) -> None:
    import torch

    buf = host.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def v1_case(route: str, geom: Any) -> dict[str, Any]:
    import torch

    backend, host = _backend(route, geom)
    try:
        _randomize(host, 1)
        ps = host.page_size
        want = _pages(host, 0, 3)
        keys = [f"{i:064x}" for i in range(3)]
        ok_set = list(backend.batch_set_v1(keys, torch.arange(0, 3 * ps)))
        n_exist = int(backend.batch_exists(keys))
        _randomize(host, 2)
        ok_get = list(backend.batch_get_v1(keys, torch.arange(4 * ps, 7 * ps)))
        got = _pages(host, 4, 3)
        stats = backend.get_stats()
        return {
            "cls": f"{type(backend).__module__}.{type(backend).__name__}",
            "set": ok_set, "exists": n_exist, "get": ok_get,
            "bytes_equal": all(torch.equal(a, b) for a, b in zip(got, want)),
            "metrics": f"{type(stats).__module__}.{type(stats).__name__}",
        }
    finally:
        backend.close()


def v2_case(route: str, geom: Any) -> dict[str, Any] | None:
    """The KV pool through ``batch_set_v2`` / ``batch_exists_v2`` /
    ``batch_get_v2``; None where the release has no v2 interface."""
    import torch

    try:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    except ImportError:
        return None
    backend, host = _backend(route, geom)
    try:
        backend.register_mem_host_pool_v2(host, PoolName.KV)
        on_registered = getattr(backend, "on_host_pools_registered", None)
        if callable(on_registered):
            on_registered()
        _randomize(host, 3)
        ps = host.page_size
        want = _pages(host, 0, 3)
        keys = [f"{i + 100:064x}" for i in range(3)]
        set_result = backend.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=torch.arange(0, 3 * ps))])
        exists = backend.batch_exists_v2(keys, [])
        _randomize(host, 4)
        get_result = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=torch.arange(4 * ps, 7 * ps))])
        got = _pages(host, 4, 3)
        return {
            "set": [bool(x) for x in set_result.get(PoolName.KV, [])],
            "exists": int(exists.kv_hit_pages),
            "get": [bool(x) for x in get_result.get(PoolName.KV, [])],
            "bytes_equal": all(torch.equal(a, b) for a, b in zip(got, want)),
        }
    finally:
        backend.close()


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def stack_case(route: str, label: str, manager_address: str) -> dict[str, Any]:
    """One pool stack of ``hybrid_pools`` (``REFUSED``: the MXFP8 KV pool)
    attached through SGLang's factory on ``route`` and round-tripped
    (``hybrid_pools.round_trip``); never raises."""
    from sglang_simm.errors import UnsupportedPoolError
    from sglang_simm_dev import hybrid_pools as hp

    try:
        if label == REFUSED:
            stack = hp.mxfp8_host_pool()
        else:
            hp.requirements()
            stack = hp.STACKS[label]("page_first")
    except hp.Missing as e:
        return {"skipped": str(e)}
    except Exception as e:  # an older release's constructors: not this release's pool
        return {"skipped": f"not built: {_error(e)}"}
    attach = hp.FactoryAttach(route, manager_address)
    try:
        if label == REFUSED:
            geom = SimpleNamespace(name="tiny-mxfp8", is_mla=False, page_size=stack.page_size)
            attach(geom, pool=stack)
            return {"accepted": True}
        return hp.round_trip(attach, stack)
    except UnsupportedPoolError as e:
        return {"refused": str(e)}
    except Exception as e:
        return {"error": _error(e)}
    finally:
        try:
            attach.close()
        except Exception:
            pass


def pools_case(route: str, manager_address: str | None = None) -> dict[str, Any]:
    """Every stack of ``hybrid_pools`` and the MXFP8 KV pool, label ->
    ``stack_case``, over one store (each stack's keys are its own)."""
    from sglang_simm_dev.hybrid_pools import STACKS

    address = manager_address or f"local://compat-pools-{route}-{uuid.uuid4().hex[:8]}"
    return {label: stack_case(route, label, address) for label in [*STACKS, REFUSED]}


def probe() -> dict[str, Any]:
    import sglang_simm

    result: dict[str, Any] = {"sglang": version("sglang"), "package": sglang_simm.__file__, "routes": ["dynamic"]}
    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:
        pass
    else:
        load_plugins()
        result["routes"].append("simm")
    for route in result["routes"]:
        for pool, geom in _geometries().items():
            result[f"{route}-{pool}"] = v1_case(route, geom)
            v2 = v2_case(route, geom)
            if v2 is not None:
                result[f"{route}-{pool}-v2"] = v2
    result["pools"] = pools_case(result["routes"][-1])
    from sglang_simm.local_store import reset_servers

    reset_servers()  # stops the local stores this probe started
    return result


def failures(result: dict[str, Any]) -> list[str]:
    """What in a probe's result is not a pass, one line each (empty: passed)."""
    problems = []
    cases = {k: v for k, v in result.items() if isinstance(v, dict) and k != "pools"}
    for name, r in cases.items():
        if name.endswith("-v2"):
            ok = r["set"] == [True] * 3 and r["exists"] == 3 and r["get"] == [True] * 3
        else:
            ok = r["cls"] == "sglang_simm.backend.HiCacheSiMM" and r["metrics"].endswith("StorageMetrics")
            ok = ok and r["set"] == [True] * 3 and r["exists"] == 3 and r["get"] == [True] * 3
        if not ok:
            problems.append(f"{name}: {r}")
        elif not r["bytes_equal"]:
            problems.append(f"{name}: pages came back with other bytes")
    release = tuple(int(x) for x in result["sglang"].split(".")[:3])
    if release >= PLUGINS_SINCE and "simm" not in result.get("routes", []):
        problems.append(f"sglang {result['sglang']} has plugin entry points but load_plugins() was not found")
    for pool in ("mha", "mla"):
        for route in result.get("routes", []):
            if f"{route}-{pool}" not in cases:
                problems.append(f"{route}-{pool}: not run")
    problems += stack_failures(result.get("pools"))
    return problems


def stack_failures(stacks: dict[str, Any] | None) -> list[str]:
    """The pool stacks that were built and did not round-trip byte for byte
    (MXFP8: was not refused); a skipped stack is not a failure."""
    if not isinstance(stacks, dict):
        return ["pools: not run"]
    problems = []
    for label, r in stacks.items():
        if "skipped" in r:
            continue
        if label == REFUSED:
            ok = "refused" in r
        else:
            ok = r.get("stored") is True and r.get("bytes_equal") is True and r.get("kv_hit") == STACK_PAGES
        if not ok:
            problems.append(f"pools {label}: {r}")
    if REFUSED not in stacks:
        problems.append(f"pools {REFUSED}: not run")
    return problems


if __name__ == "__main__":
    print(json.dumps(probe()))
