"""pytest-benchmark view of ``sglang-simm-dev bench`` (not part of the test suite).

Run with ``pytest benchmarks`` (needs pytest-benchmark: ``pip install -e './dev[bench]'``;
without it ``conftest.py`` stops the run with that hint).
Each group holds ours and SGLang's in-tree backend for one client, operation
and batch size, so ``--benchmark-compare`` and the group table read as
in-tree against ours. The rigs and checks are ``sglang_simm_dev.bench``'s::

    pytest benchmarks --benchmark-group-by=group --benchmark-columns=median,iqr,ops
    pytest benchmarks -k "null and 128"          # one slice
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang_simm_dev import bench  # noqa: E402

PAGES = (1, 8, 32, 128, 1024)
BACKENDS = ("ours", "in-tree")


@pytest.fixture(scope="module")
def pool():
    from sglang_simm_dev.pools import build_host_pool

    p = build_host_pool(bench.OVERHEAD_GEOMETRY, tokens=max(PAGES) * bench.OVERHEAD_GEOMETRY.page_size)
    bench.fill_pool(p)
    return p


@pytest.fixture(scope="module")
def null_rig(pool):
    rig = bench.OverheadRig("null", max(PAGES), pool=pool)
    checks = bench.Checks()
    rig.check_clients(checks)
    assert checks.ok, checks.failures
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def embedded_rig(pool):
    with bench.local_store_server(1 << 30):
        rig = bench.OverheadRig("local", max(PAGES), pool=pool)
        checks = bench.Checks()
        rig.check_clients(checks)
        assert checks.ok, checks.failures
        yield rig
        rig.close()


def _run(benchmark, rig, backend: str, op: str, n: int) -> None:
    benchmark.group = f"{rig.client}-{op}-{n:04d}"
    benchmark.extra_info.update(client=rig.client, backend=backend, op=op, pages=n,
                                meaning=bench.OP_MEANING[op])
    rig.prepare(op)
    timed = rig.call(backend, op, n)
    checks = bench.Checks()
    if timed.setup is not None or timed.prepare is not None:
        # a get after its lookup, or a call on the store: untimed set-up before each round
        setup = timed.setup if timed.setup is not None else (lambda: timed.prepare(1))
        result = benchmark.pedantic(timed.fn, setup=setup, rounds=30, warmup_rounds=2)
    else:
        result = benchmark(timed.fn)
    bench.check_result(checks, f"{rig.client}/{backend}/{op}", op, result, n)
    assert checks.ok, checks.failures


@pytest.mark.parametrize("n", PAGES)
@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_null_client(benchmark, null_rig, backend, op, n):
    """Own overhead: the null client answers at once."""
    _run(benchmark, null_rig, backend, op, n)


@pytest.mark.parametrize("n", PAGES)
@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_embedded_store(benchmark, embedded_rig, backend, op, n):
    """The whole data path on the local store (64 KiB pages)."""
    _run(benchmark, embedded_rig, backend, op, n)


@pytest.fixture(scope="module", params=["1mib", "llama3-8b", "deepseek-v3"])
def bandwidth_rig(request):
    with bench.local_store_server(2 << 30):
        rig = bench.BandwidthRig(request.param, bench.BANDWIDTH_CASES[request.param], 16, capacity=2 << 30)
        yield rig
        rig.close()


@pytest.mark.parametrize("what", ["set", "get", "torch-copy"])
def test_bandwidth(benchmark, bandwidth_rig, what):
    """Ours on the local store against a torch copy of the same bytes."""
    rig = bandwidth_rig
    benchmark.group = f"bandwidth-{rig.label}"
    benchmark.extra_info.update(bytes=rig.nbytes, object_bytes=rig.object_sizes)
    if what == "set":
        result = benchmark.pedantic(rig.set, setup=rig.unset, rounds=7, warmup_rounds=1)
        assert all(result)
    elif what == "get":
        rig.unset()
        assert all(rig.set())
        result = benchmark.pedantic(rig.get, rounds=7, warmup_rounds=1)
        assert all(result)
        checks = bench.Checks()
        rig.verify(checks)
        assert checks.ok, checks.failures
    else:
        benchmark.pedantic(rig.torch_copy, rounds=7, warmup_rounds=1)
    stats = benchmark.stats.stats if hasattr(benchmark.stats, "stats") else benchmark.stats
    benchmark.extra_info["GB/s"] = rig.nbytes / 1e9 / stats.median
