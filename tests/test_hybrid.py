"""Hybrid models: the v2 pool-transfer interface.

Pure hit-policy functions first, then SGLang's real hybrid host pools (a
Mamba state pool, an SWA and a draft KV pool, a DSA indexer pool) on the
CPU, bound to the backend the way SGLang 0.5.23's hybrid controller binds
them, over the local store.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pages import hashes, page, region_count, slots
from sglang_simm import hybrid, keys as keyspace
from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import derive_region_geometry
from sglang_simm_dev.hybrid_pools import transfer
from sglang_simm_dev.pools import MAMBA_CAPACITY, mamba_pool


def tiny(**changes):
    from sglang_simm_dev.pools import PRESETS

    return dataclasses.replace(PRESETS["tiny"], **changes)


def tiny_mla(**changes):
    from sglang_simm_dev.pools import ModelGeometry

    base = ModelGeometry("tiny-mla", 2, 1, 48, 4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16)
    return dataclasses.replace(base, **changes)

# ---------------------------------------------------------------- pure: policies


def flags(text: str) -> list[bool]:
    """``"11011"`` -> [True, True, False, True, True]."""
    return [c == "1" for c in text]


def stops(mask: np.ndarray) -> list[int]:
    return (np.flatnonzero(mask) + 1).tolist()


@pytest.mark.parametrize(
    "pages, boundary",
    [("", 0), ("0", 0), ("1", 1), ("111", 3), ("110111", 2), ("0111", 0)],
)
def test_all_pages_restores_only_up_to_the_first_missing_page(pages, boundary):
    got, mask = hybrid.all_pages_stops(flags(pages))
    assert got == boundary
    assert stops(mask) == list(range(1, boundary + 1))


@pytest.mark.parametrize(
    "pages, window, expected",
    [
        # Mamba (window 1): a state exists only at node ends.
        ("010010", 1, [2, 5]),
        ("000000", 1, []),
        ("111111", 1, [1, 2, 3, 4, 5, 6]),
        # SWA (window 2): the two pages before the stop point must exist;
        # near the start the window is clipped at page 0.
        ("111011", 2, [1, 2, 3, 6]),
        ("011011", 2, [3, 6]),
        ("101010", 2, [1]),
        ("111111", 3, [1, 2, 3, 4, 5, 6]),
        ("110111", 3, [1, 2, 6]),
        ("", 4, []),
    ],
)
def test_trailing_pages_needs_the_window_before_each_stop(pages, window, expected):
    boundary, mask = hybrid.trailing_pages_stops(flags(pages), window)
    assert stops(mask) == expected
    assert boundary == (expected[-1] if expected else 0)


def _reference_trailing(pages: list[bool], window: int) -> list[int]:
    """SGLang's file backend, literally."""
    trailing = max(1, window)
    return [
        p for p in range(1, len(pages) + 1)
        if all(pages[i] for i in range(max(0, p - trailing), p))
    ]


def test_trailing_pages_agrees_with_sglangs_own_loop_on_random_pools():
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(0, 14)
        pages = [rng.random() < 0.7 for _ in range(n)]
        window = rng.randint(1, 5)
        _, mask = hybrid.trailing_pages_stops(pages, window)
        assert stops(mask) == _reference_trailing(pages, window), (pages, window)


def q(name, policy, pages, window=1):
    return hybrid.PoolQuery(name=name, policy=policy, window=window, page_exists=np.asarray(flags(pages)))


def test_fold_intersects_every_pools_restorable_lengths():
    v = hybrid.fold_hits(6, [
        q("mamba", hybrid.TRAILING_PAGES, "010010"),          # {2, 5}
        q("swa", hybrid.TRAILING_PAGES, "111011", window=2),  # {1, 2, 3, 6}
    ])
    assert v.restorable_prefix_pages == [2]
    assert v.kv_hit_pages == 2
    assert v.pool_hit_pages == {"kv": 6, "mamba": 5, "swa": 6}


def test_fold_of_kv_alone_is_every_prefix():
    v = hybrid.fold_hits(3, [])
    assert (v.kv_hit_pages, v.pool_hit_pages, v.restorable_prefix_pages) == (3, {"kv": 3}, [1, 2, 3])
    assert hybrid.fold_hits(0, []) == hybrid.miss()


def test_fold_never_widens_the_kv_hit():
    v = hybrid.fold_hits(3, [q("draft", hybrid.ALL_PAGES, "111"), q("mamba", hybrid.TRAILING_PAGES, "111")])
    assert v.kv_hit_pages == 3 and max(v.restorable_prefix_pages) == 3
    assert all(pages <= 3 for pages in v.pool_hit_pages.values())


def test_fold_stops_once_nothing_is_restorable_like_sglang():
    # SGLang's file and Mooncake backends break out of the pool loop once the
    # restorable set is empty: later pools get no verdict. Zero boundaries
    # are omitted.
    v = hybrid.fold_hits(4, [
        q("draft", hybrid.ALL_PAGES, "0111"),
        q("mamba", hybrid.TRAILING_PAGES, "1111"),
    ])
    assert v == hybrid.HitVerdict(0, {"kv": 4}, [])


def test_fold_refuses_what_it_cannot_evaluate():
    with pytest.raises(ValueError, match="BLOCK_GROUPS"):
        hybrid.fold_hits(2, [q("c4", hybrid.BLOCK_GROUPS, "11")])
    with pytest.raises(ValueError, match="2 page flags for 3"):
        hybrid.fold_hits(3, [q("swa", hybrid.ALL_PAGES, "11")])


def test_names_policies_and_windows_as_sglang_spells_them():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    assert hybrid.pool_name(PoolName.MAMBA) == "mamba" and hybrid.pool_name("swa") == "swa"
    assert hybrid.policy_name(PoolHitPolicy.TRAILING_PAGES) == hybrid.TRAILING_PAGES
    assert hybrid.policy_name("ALL_PAGES") == hybrid.ALL_PAGES
    assert hybrid.trailing_window(None) == 1 and hybrid.trailing_window([]) == 1
    assert hybrid.trailing_window(["__placeholder__"] * 3) == 3
    assert hybrid.unsupported_policy_reason(PoolHitPolicy.ALL_PAGES) is None
    assert "BLOCK_GROUPS" in hybrid.unsupported_policy_reason(PoolHitPolicy.BLOCK_GROUPS)
    assert "unknown" in hybrid.unsupported_policy_reason("sometimes")


def test_verdict_becomes_sglangs_pool_transfer_result():
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    r = hybrid.to_pool_transfer_result(hybrid.HitVerdict(2, {"kv": 6, PoolName.MAMBA: 5}, [2]))
    assert isinstance(r, PoolTransferResult)
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [2]
    # what the controller reads
    assert r.extra_pool_hit_pages.get(PoolName.KV) == 6 and PoolName.MAMBA in r.extra_pool_hit_pages


# ------------------------------------------------------ pure: keys, geometry


def test_side_pool_objects_have_their_own_names_and_namespace():
    base = keyspace.PageIdentity("m", False, 2, 1, 1, 0, 1, "torch.bfloat16", "page_first", (256, 96))
    mamba = dataclasses.replace(base, pool="mamba")
    assert keyspace.named_part_suffixes(mamba, ["temporal", "conv0"]) == (".mamba.temporal", ".mamba.conv0")
    assert keyspace.named_part_suffixes(mamba, ["t"], chunks=2) == (".mamba.t.c0", ".mamba.t.c1")
    assert keyspace.namespaced_prefix(mamba) != keyspace.namespaced_prefix(base)
    with pytest.raises(ValueError):
        keyspace.named_part_suffixes(base, ["temporal"])


def _two_buffer_meta(a: int, b: int, stride_a: int, stride_b: int, size_a: int, size_b: int):
    def meta(indices):
        ptrs, sizes = [], []
        for i in indices:
            ptrs += [a + i * stride_a, b + i * stride_b]
            sizes += [size_a, size_b]
        return ptrs, sizes

    return meta


def test_region_geometry_fits_each_buffer_with_its_own_stride():
    slots = 10
    a, b = 1 << 20, 1 << 24
    meta = _two_buffer_meta(a, b, 256, 20, 256, 20)
    g, owners = derive_region_geometry(
        meta, page_size=1, pool_tokens=slots, regions=[(b, 20 * slots), (a, 256 * slots)],
        make_indices=lambda lo, hi: list(range(lo, hi)),
    )
    assert owners.tolist() == [1, 0]
    assert g.page_stride.tolist() == [256, 20] and g.sizes.tolist() == [256, 20]
    want = meta(list(range(slots)))[0]
    assert g.pointers(np.arange(slots)).tolist() == want


def test_region_geometry_chunks_every_part_alike():
    a, b = 1 << 20, 1 << 24
    meta = _two_buffer_meta(a, b, 100, 40, 100, 40)
    g, owners = derive_region_geometry(
        meta, page_size=1, pool_tokens=4, regions=[(a, 400), (b, 160)],
        make_indices=lambda lo, hi: list(range(lo, hi)), value_limit=64,
    )
    assert g.chunks == 2 and g.object_bytes == (100, 40)
    assert g.sizes.tolist() == [50, 50, 20, 20] and owners.tolist() == [0, 0, 1, 1]
    assert g.pointers(np.array([2])).tolist() == [a + 200, a + 250, b + 80, b + 100]


def test_region_geometry_refuses_an_object_outside_every_buffer():
    meta = _two_buffer_meta(1 << 20, 1 << 24, 256, 20, 256, 20)
    with pytest.raises(UnsupportedPoolError, match="none of the host pool's buffers"):
        derive_region_geometry(
            meta, page_size=1, pool_tokens=10, regions=[(1 << 20, 2560)],
            make_indices=lambda lo, hi: list(range(lo, hi)),
        )


# ------------------------------------------------------------ real host pools


def kv_side_pool(geom, tokens=32, layout="page_first"):
    from sglang_simm_dev.pools import build_host_pool

    return build_host_pool(geom, tokens=tokens, layout=layout)


def buffers(pool) -> list[torch.Tensor]:
    if isinstance(pool.kv_buffer, torch.Tensor):
        return [pool.kv_buffer]
    return [t for t in pool.get_hybrid_pool_buffer() if t.numel()]


def randomize(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in buffers(pool):
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


@pytest.fixture
def hybrid_attach(attach):
    """(backend, pools) with SGLang 0.5.23's attach order: the KV anchor
    through create_backend + register_mem_pool_host, then every pool-group
    entry (KV included) through register_mem_host_pool_v2, then
    on_host_pools_registered."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    def _attach(*, extra=None, side=("mamba", "swa", "draft"), **fields):
        backend, kv = attach(tiny(), tokens=32, extra=extra, **fields)
        pools = {"kv": kv}
        if "mamba" in side:
            pools["mamba"] = mamba_pool()
        if "swa" in side:
            pools["swa"] = kv_side_pool(tiny(layer_num=1, name="swa-layers"))
        if "draft" in side:
            pools["draft"] = kv_side_pool(tiny(layer_num=1, head_num=1, name="draft-model"))
        names = {"kv": PoolName.KV, "mamba": PoolName.MAMBA, "swa": PoolName.SWA, "draft": PoolName.DRAFT}
        for key, pool in pools.items():
            backend.register_mem_host_pool_v2(pool, names[key])
        backend.on_host_pools_registered()
        return backend, pools

    return _attach


def test_side_pools_are_bound_once_and_the_kv_anchor_is_not_bound_twice(hybrid_attach, caplog):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    with caplog.at_level(logging.INFO, logger="sglang_simm.backend"):
        backend, pools = hybrid_attach()
    assert sorted(backend.pools.side) == ["draft", "mamba", "swa"]
    assert backend.pools.kv.pool is pools["kv"]
    assert len(backend.pools.kv.mrs) == 1 and len(backend.pools.side["mamba"].mrs) == 3
    bound = next(r.getMessage() for r in caplog.records if "host pools bound" in r.getMessage())
    for name in ("kv (MHATokenToKVPoolHost", "mamba (MambaPoolHost", "swa (", "draft ("):
        assert name in bound
    # the same pool again (a sidecar re-announced) changes nothing
    binding = backend.pools.side["mamba"]
    backend.register_mem_host_pool_v2(pools["mamba"], PoolName.MAMBA)
    backend.register_mem_host_pool_v2(pools["kv"], PoolName.KV)
    assert backend.pools.side["mamba"] is binding and len(backend.pools.side) == 3


def test_mamba_geometry_is_the_pools_own_for_every_slot(hybrid_attach):
    backend, pools = hybrid_attach(side=("mamba",))
    mamba, b = pools["mamba"], backend.pools.side["mamba"]
    every = torch.arange(mamba.size, dtype=torch.int64)
    ptrs, sizes = mamba.get_page_buffer_meta(every)
    assert b.geometry.pointers(every.numpy()).tolist() == ptrs
    assert b.sizes_list * mamba.size == sizes
    assert b.suffixes == (".mamba.temporal", ".mamba.conv0", ".mamba.conv1")
    assert b.page_bytes == mamba.get_size_per_token()


def test_side_pool_pages_round_trip_byte_for_byte(hybrid_attach):
    backend, pools = hybrid_attach(enable_storage_metrics=True)
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, count_pool_hits

    mamba, swa, draft = pools["mamba"], pools["swa"], pools["draft"]
    for seed, pool in enumerate((mamba, swa, draft), start=1):
        randomize(pool, seed)
    keys = hashes(4)
    want = {
        "mamba": [page(mamba, 3)],
        "swa": [page(swa, p) for p in (1, 2)],
        "draft": [page(draft, p) for p in range(2, 6)],
    }
    trailing = PoolHitPolicy.TRAILING_PAGES
    stored = backend.batch_set_v2([
        # a Mamba state under the hash of its node's last page
        transfer(PoolName.MAMBA, keys=[keys[3]], host_indices=torch.tensor([3]), policy=trailing),
        # an SWA window: the node's last two pages
        transfer(PoolName.SWA, keys=keys[2:4], host_indices=slots(swa, 1, 2), policy=trailing),
        # a KV-derived sidecar: every page
        transfer(PoolName.DRAFT, keys=keys, host_indices=slots(draft, 2, 4)),
    ])
    assert stored == {PoolName.MAMBA: [True], PoolName.SWA: [True, True], PoolName.DRAFT: [True] * 4}

    for seed, pool in enumerate((mamba, swa, draft), start=11):
        randomize(pool, seed)  # the host pools forget everything
    got = backend.batch_get_v2([
        transfer(PoolName.MAMBA, keys=[keys[3]], host_indices=torch.tensor([9]), policy=trailing),
        transfer(PoolName.SWA, keys=keys[2:4], host_indices=slots(swa, 5, 2), policy=trailing),
        transfer(PoolName.DRAFT, keys=keys, host_indices=slots(draft, 6, 4)),
    ])
    assert count_pool_hits(got) == {PoolName.MAMBA: 1, PoolName.SWA: 2, PoolName.DRAFT: 4}
    assert torch.equal(page(mamba, 9), want["mamba"][0])
    for i, p in enumerate((5, 6)):
        assert torch.equal(page(swa, p), want["swa"][i])
    for i, p in enumerate(range(6, 10)):
        assert torch.equal(page(draft, p), want["draft"][i])
    stats = backend.stats()
    assert stats["pages_read"] == 7 and stats["errors"] == {}
    metrics = backend.get_stats()
    assert metrics.prefetch_pgs == [7] and metrics.backup_pgs == [7]


def assert_state_round_trips(backend, pool, key, *, seed):
    """A Mamba state written from slot 2 reads back whole into slot 5 of a
    scrambled pool, and the slots beside it (4, 6) keep their bytes."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    randomize(pool, seed)
    want = page(pool, 2)
    assert backend.batch_set_v2([transfer(PoolName.MAMBA, keys=key, host_indices=torch.tensor([2]))]) == {
        PoolName.MAMBA: [True]
    }
    randomize(pool, seed + 1)
    beside = [page(pool, 4), page(pool, 6)]
    assert backend.batch_get_v2([transfer(PoolName.MAMBA, keys=key, host_indices=torch.tensor([5]))]) == {
        PoolName.MAMBA: [True]
    }
    assert torch.equal(page(pool, 5), want)
    assert all(torch.equal(page(pool, p), was) for p, was in zip((4, 6), beside))


def test_a_conv_only_mamba_pool_has_no_temporal_object(hybrid_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, _ = hybrid_attach(side=())
    pool = mamba_pool(temporal=(0,), convs=((3, 8),))
    backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    b = backend.pools.side["mamba"]
    assert b.suffixes == (".mamba.conv0",) and len(b.mrs) == 1
    assert_state_round_trips(backend, pool, hashes(1, "conv"), seed=3)


def test_a_mamba_pools_per_slot_side_states_travel_with_its_states(hybrid_attach):
    """SGLang 0.5.22+ Mamba pools with extra_checkpoint_buffers: SGLang's own
    zero-copy description leaves the side states out (it raises), its
    whole-page accessor includes them. Every byte of the slot, side states
    included, comes back; the slots beside it are left alone."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, _ = hybrid_attach(side=())
    extra = (torch.zeros(MAMBA_CAPACITY, 5, dtype=torch.float32), torch.zeros(MAMBA_CAPACITY, 3, 2, dtype=torch.int8))
    pool = mamba_pool(extra=extra)
    backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    b = backend.pools.side["mamba"]
    assert b.suffixes[-2:] == (".mamba.state0", ".mamba.state1") and len(b.mrs) == 5
    assert b.page_bytes == pool.get_size_per_token()
    assert_state_round_trips(backend, pool, hashes(1, "side"), seed=5)


def test_a_v2_write_is_one_mput_of_every_pool_and_no_lookup(hybrid_attach):
    """As on v1: serving's backups are new pages, so v2 puts every object
    of every pool in one mput, without asking mexists first; pages stored
    before are put again (the same bytes) and read back right."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("swa", "draft"))
    keys = hashes(3)
    swa, draft = pools["swa"], pools["draft"]
    randomize(swa, 11)
    randomize(draft, 12)
    want = {"swa": [page(swa, p) for p in range(4)], "draft": [page(draft, p) for p in range(4)]}

    def both(n, first):
        return [transfer(PoolName.SWA, keys=hashes(n), host_indices=slots(swa, first, n)),
                transfer(PoolName.DRAFT, keys=hashes(n), host_indices=slots(draft, first, n))]

    assert backend.batch_set_v2(both(3, 0)) == {PoolName.SWA: [True] * 3, PoolName.DRAFT: [True] * 3}
    puts, lookups = [], []
    real_mput, real_mexists = backend.client.mput_views, backend.client.mexists
    backend.client.mput_views = lambda k, v: puts.append(list(k)) or real_mput(k, v)
    backend.client.mexists = lambda k: lookups.append(list(k)) or [False] * len(k)
    backend.client.mexists_codes = lambda k: lookups.append(list(k)) or [1] * len(k)
    assert backend.batch_set_v2(both(4, 0)) == {PoolName.SWA: [True] * 4, PoolName.DRAFT: [True] * 4}
    assert lookups == [] and len(puts) == 1
    assert len(puts[0]) == 4 * (backend.pools.side["swa"].parts + backend.pools.side["draft"].parts)
    randomize(swa, 13)
    randomize(draft, 14)
    backend.client.mexists = real_mexists
    assert backend.batch_get_v2(both(4, 4)) == {PoolName.SWA: [True] * 4, PoolName.DRAFT: [True] * 4}
    assert all(torch.equal(page(swa, 4 + p), want["swa"][p]) for p in range(4))
    assert all(torch.equal(page(draft, 4 + p), want["draft"][p]) for p in range(4))


def test_lookups_and_reads_on_v1_and_v2_alike_load_each_pools_own_pages(hybrid_attach):
    """A KV lookup (v1, or v2's KV part) between writes and reads changes
    nothing a read loads: KV and side pool pages each read their own bytes,
    on either path, whatever was looked up before."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("swa",))
    for pool in pools.values():
        randomize(pool, 41)
    keys = hashes(3)
    want_kv = [page(pools["kv"], p) for p in range(3)]
    want_swa = [page(pools["swa"], p) for p in range(3)]
    assert all(backend.batch_set_v1(keys, slots(pools["kv"], 0, 3)))
    t = transfer(PoolName.SWA, keys=keys, host_indices=slots(pools["swa"], 0, 3))
    assert backend.batch_set_v2([t]) == {PoolName.SWA: [True] * 3}
    for looked_up in ([], keys, keys[1:]):
        if looked_up:
            assert backend.batch_exists(looked_up) == len(looked_up)
            q = transfer(PoolName.SWA, keys=looked_up, host_indices=slots(pools["swa"], 4, len(looked_up)))
            assert result(backend.batch_exists_v2(looked_up, [q]))[0] == len(looked_up)
        for pool in pools.values():
            randomize(pool, 42)
        assert all(backend.batch_get_v1(keys, slots(pools["kv"], 4, 3)))
        t = transfer(PoolName.SWA, keys=keys, host_indices=slots(pools["swa"], 4, 3))
        assert backend.batch_get_v2([t]) == {PoolName.SWA: [True] * 3}
        assert all(torch.equal(page(pools["kv"], 4 + p), want_kv[p]) for p in range(3))
        assert all(torch.equal(page(pools["swa"], 4 + p), want_swa[p]) for p in range(3))


# ------------------------------------------------ hit query, hand-worked cases


class Seeded:
    """A backend whose store holds KV pages and side-pool objects under
    chosen page keys: ``"110111"`` = stored for pages 0, 1, 3, 4, 5."""

    def __init__(self, backend, pools, n=6):
        self.backend, self.pools = backend, pools
        self.keys = hashes(n, "seeded")
        for pool in pools.values():
            randomize(pool, 5)

    def store(self, name: str, pattern: str) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        wanted = [k for k, c in zip(self.keys, pattern) if c == "1"]
        if not wanted:
            return
        pool = self.pools[name]
        indices = slots(pool, 0, len(wanted))
        if name == "kv":
            assert all(self.backend.batch_set_v1(wanted, indices))
        else:
            assert all(self.backend.batch_set_v2([transfer(PoolName(name), keys=wanted, host_indices=indices)])[name])

    def query(self, *transfers):
        return self.backend.batch_exists_v2(list(self.keys), list(transfers))


def mamba_query():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    return transfer(PoolName.MAMBA, keys=["__placeholder__"], policy=PoolHitPolicy.TRAILING_PAGES)


def swa_query(window):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    return transfer(PoolName.SWA, keys=["__placeholder__"] * window, policy=PoolHitPolicy.TRAILING_PAGES)


def draft_query(keys=None):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    return transfer(PoolName.DRAFT, keys=keys, policy=PoolHitPolicy.ALL_PAGES)


@pytest.fixture
def seeded(hybrid_attach):
    backend, pools = hybrid_attach()
    return Seeded(backend, pools)


def result(r):
    return r.kv_hit_pages, {str(k): v for k, v in r.extra_pool_hit_pages.items()}, r.restorable_prefix_pages


def test_mamba_states_are_found_under_the_last_kv_page_of_each_node(seeded):
    seeded.store("kv", "111111")
    seeded.store("mamba", "010010")  # nodes end at pages 2 and 5
    assert result(seeded.query(mamba_query())) == (5, {"kv": 6, "mamba": 5}, [2, 5])


def test_missing_trailing_state_shortens_or_voids_the_hit(seeded):
    seeded.store("kv", "111111")
    assert result(seeded.query(mamba_query())) == (0, {"kv": 6}, [])
    seeded.store("mamba", "010000")
    assert result(seeded.query(mamba_query())) == (2, {"kv": 6, "mamba": 2}, [2])


def test_an_swa_window_with_a_hole_leaves_holes_in_the_restorable_set(seeded):
    seeded.store("kv", "111111")
    seeded.store("swa", "111011")
    assert result(seeded.query(swa_query(2))) == (6, {"kv": 6, "swa": 6}, [1, 2, 3, 6])
    # with Mamba states at pages 2 and 5 only length 2 survives both pools
    seeded.store("mamba", "010010")
    assert result(seeded.query(mamba_query(), swa_query(2))) == (2, {"kv": 6, "mamba": 5, "swa": 6}, [2])


def test_a_hole_in_an_all_pages_pool_cuts_the_hit_there(seeded):
    seeded.store("kv", "111111")
    seeded.store("draft", "110111")
    assert result(seeded.query(draft_query(seeded.keys))) == (2, {"kv": 6, "draft": 2}, [1, 2])
    # KV-derived sidecars may carry no keys in the query; lookups use the KV keys anyway
    assert result(seeded.query(draft_query(None))) == (2, {"kv": 6, "draft": 2}, [1, 2])


def test_side_pools_never_widen_the_kv_hit(seeded):
    seeded.store("kv", "111011")
    for name in ("mamba", "swa", "draft"):
        seeded.store(name, "111111")
    r = seeded.query(mamba_query(), swa_query(2), draft_query())
    assert result(r) == (3, {"kv": 3, "mamba": 3, "swa": 3, "draft": 3}, [1, 2, 3])
    # no KV page at all: nothing to restore, whatever the pools hold
    r = seeded.backend.batch_exists_v2(["not-stored"] + seeded.keys[1:], [mamba_query(), draft_query()])
    assert result(r) == (0, {}, [])


def test_the_controller_reads_the_result_as_it_does_sglangs_backends(seeded):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    seeded.store("kv", "111111")
    seeded.store("mamba", "010010")
    query = mamba_query()
    r = seeded.query(query)
    # HybridCacheController._storage_hit_query
    pool_hits = r.extra_pool_hit_pages
    assert pool_hits.get(PoolName.KV, r.kv_hit_pages) == 6
    assert query.name in pool_hits and pool_hits[query.name] == 5
    assert r.restorable_prefix_pages == sorted(r.restorable_prefix_pages)


def test_block_groups_is_answered_as_a_miss_and_counted(seeded, caplog):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    seeded.store("kv", "111111")
    block = dataclasses.replace(
        transfer(PoolName.DRAFT, keys=seeded.keys, policy=PoolHitPolicy.BLOCK_GROUPS), block_pages=2, group_pages=1
    )
    with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
        assert result(seeded.query(block)) == (0, {}, [])
    assert "BLOCK_GROUPS is not supported" in caplog.text
    assert seeded.backend.stats()["errors"] == {"unsupported_hit_policy": 1}


def test_an_unregistered_pool_restores_nothing(hybrid_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("swa",))
    s = Seeded(backend, pools)
    s.store("kv", "111111")
    assert result(s.query(mamba_query())) == (0, {"kv": 6}, [])
    got = backend.batch_get_v2([transfer(PoolName.MAMBA, keys=s.keys[:1], host_indices=torch.tensor([0]))])
    assert got == {PoolName.MAMBA: [False]}
    assert backend.stats()["errors"]["unregistered_pool"] == 2


# ------------------------------------------------------ keys across ranks


def test_mamba_keys_carry_the_tp_rank_and_mla_draft_keys_do_not(attach):
    """Mamba state is TP-sharded (every rank writes its own, even beside MLA
    KV); an MLA draft pool is replicated (only the writer rank stores it)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    prefixes = []
    for rank in (0, 1):
        backend, _ = attach(tiny_mla(), tokens=32, tp_size=2, tp_rank=rank)
        backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
        backend.register_mem_host_pool_v2(kv_side_pool(tiny_mla(layer_num=1, name="draft")), PoolName.DRAFT)
        prefixes.append((backend.pools.side["mamba"].prefix, backend.pools.side["draft"].prefix))
        assert backend.pools.side["draft"].suffixes == (".draft.kv",)
    assert prefixes[0][0] != prefixes[1][0]
    assert prefixes[0][1] == prefixes[1][1]


def test_sglang_backs_side_pools_up_on_mla_non_writer_ranks_only_for_mamba():
    """The premise of leaving the MHA draft out below, read from SGLang's own controller:
    on a rank that is not the MLA storage writer, only Mamba state is backed
    up for this backend's names (Mooncake's MHA drafts are its own case)."""
    import types

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    for backend_type in ("simm", "dynamic"):
        rank1 = types.SimpleNamespace(backup_skip=True, storage_backend_type=backend_type)
        assert not HybridCacheController.should_backup(rank1, transfer(PoolName.DRAFT, keys=[]))
        assert HybridCacheController.should_backup(rank1, transfer(PoolName.MAMBA, keys=[]))


def test_an_mha_draft_of_an_mla_model_at_tp_2_is_left_out_and_the_targets_hits_stand(attach, caplog):
    """Two ranks of one TP-2 server (two storage configs): an MHA draft
    pool's heads differ per rank, yet only rank 0 would write it, so rank 1
    would always miss and void every prefetch. Both ranks leave it out with
    a warning naming the cost and the fix, and answer for the target alone:
    no verdict for the draft (absent from every answer), the KV hit whole;
    Mamba state and an MLA draft stay stored."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, count_pool_hits

    keys = hashes(3)
    for rank in (0, 1):
        backend, kv = attach(tiny_mla(), tokens=32, tp_size=2, tp_rank=rank)
        mha_draft = kv_side_pool(tiny(layer_num=1, head_num=1, name="draft-model"))
        with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
            backend.register_mem_host_pool_v2(mha_draft, PoolName.DRAFT)
        warned = [r.getMessage() for r in caplog.records if "leaves it out of L3" in r.getMessage()]
        assert len(warned) == rank + 1 and "'draft'" in warned[-1] and "TP 2" in warned[-1]
        assert "MLA draft" in warned[-1] and "speculative acceptance" in warned[-1]
        assert "draft" not in backend.pools.side and "draft" in backend.pools.left_out
        if rank == 0:
            assert backend.batch_set_v1(keys, slots(kv, 0, 3)) == [True] * 3
        draft_t = transfer(PoolName.DRAFT, keys=keys, host_indices=slots(mha_draft, 0, 3))
        hit = backend.batch_exists_v2(keys, [draft_t])
        assert hit.kv_hit_pages == 3 and PoolName.DRAFT not in hit.extra_pool_hit_pages
        assert backend.batch_set_v2([draft_t]) == {} and backend.batch_get_v2([draft_t]) == {}
        assert count_pool_hits(backend.batch_get_v2([draft_t])) == {}
        backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
        backend.register_mem_host_pool_v2(kv_side_pool(tiny_mla(layer_num=1, name="draft")), PoolName.DRAFT)
        assert sorted(backend.pools.side) == ["draft", "mamba"] and backend.pools.left_out == {}


def test_an_mha_draft_of_an_mla_model_round_trips_at_tp_1(attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, _ = attach(tiny_mla(), tokens=32, tp_size=1, tp_rank=0)
    draft = kv_side_pool(tiny(layer_num=1, head_num=1, name="draft-model"))
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    randomize(draft, 7)
    keys = hashes(2)
    want = [page(draft, p) for p in range(2)]
    assert backend.batch_set_v2([transfer(PoolName.DRAFT, keys=keys, host_indices=slots(draft, 0, 2))]) == {
        PoolName.DRAFT: [True, True]}
    randomize(draft, 8)
    got = backend.batch_get_v2([transfer(PoolName.DRAFT, keys=keys, host_indices=slots(draft, 2, 2))])
    assert got == {PoolName.DRAFT: [True, True]}
    assert all(torch.equal(page(draft, 2 + p), want[p]) for p in range(2))


def test_mamba_keys_carry_the_dtype_of_every_state(attach):
    """SGLang's MambaPoolHost.dtype is the conv state's; a bf16 and an fp16
    temporal state of one model hold different bytes (same sizes)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    prefixes = {}
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        backend, _ = attach(tiny(), tokens=32)
        pool = mamba_pool(temporal_dtype=dtype)
        assert pool.dtype == torch.bfloat16  # the conv dtype, whatever the temporal state's
        backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
        b = backend.pools.side["mamba"]
        assert str(dtype) in b.identity.dtype
        prefixes.setdefault(dtype, set()).add(b.prefix)
    assert len(prefixes[torch.bfloat16]) == 1  # one model, one dtype: one namespace
    assert prefixes[torch.bfloat16] != prefixes[torch.float16]


# --------------------------------------------- DSA indexer (DeepSeek V3.2)

DSA_PAGE = 64  # DSATokenToKVPool requires 64-token index pages
DSA_TOKENS = 4 * DSA_PAGE


def dsa_geometry():
    return tiny_mla(name="tiny-dsa", page_size=DSA_PAGE)


@pytest.fixture
def dsa_attach(attach):
    """(backend, anchor, indexer): SGLang's CPU ``DSATokenToKVPool``, its MLA
    host anchor, and the indexer host pool built from the device pool's own
    ``host_pool_decls()`` by the decl's builder, as the hybrid pool assembler
    does; the backend's KV pool is the anchor."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerHostPoolBuilder, DSAIndexerPoolHost

    from sglang_simm_dev.pools import build_host_pool

    geom = dsa_geometry()
    device = DSATokenToKVPool(
        size=DSA_TOKENS, page_size=DSA_PAGE, kv_lora_rank=geom.kv_lora_rank, dtype=geom.dtype,
        qk_rope_head_dim=geom.qk_rope_head_dim, layer_num=geom.layer_num, device="cpu",
        index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=geom.kv_lora_rank + geom.qk_rope_head_dim,
        index_buf_size=DSA_TOKENS,  # what it derives itself with no decode context parallelism
    )
    anchor = build_host_pool(geom, tokens=DSA_TOKENS, device_pool=device)
    decl = next(d for d in device.host_pool_decls() if d.pool_name == PoolName.INDEXER)
    assert decl.indices_from_pool == PoolName.KV  # a KV-derived sidecar
    assert isinstance(decl.host_pool_builder, DSAIndexerHostPoolBuilder)
    # what decl.host_pool_builder.build() makes, less the pinning (no GPU driver)
    indexer = DSAIndexerPoolHost(decl=decl, anchor_host=anchor, pin_memory=False, device="cpu")
    backend, _ = attach(geom, pool=anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    backend.on_host_pools_registered()
    return backend, anchor, indexer


def test_the_dsa_indexer_is_bound_as_one_replicated_object_per_page(dsa_attach):
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    backend, anchor, indexer = dsa_attach
    assert type(indexer) is DSAIndexerPoolHost
    b = backend.pools.side["indexer"]
    assert b.suffixes == (".indexer.o0",) and len(b.mrs) == 1
    # one object per page: every layer's packed index keys and scales
    every = torch.arange(0, indexer.size, dtype=torch.int64)
    ptrs, sizes = indexer.get_page_buffer_meta(every)
    pages = np.arange(0, indexer.size, indexer.page_size)
    assert b.geometry.pointers(pages).tolist() == ptrs
    assert b.sizes_list * len(ptrs) == sizes
    assert b.page_bytes == indexer.get_size_per_token() * indexer.page_size
    # DSA index keys are identical on every TP rank, like the MLA KV they ride on
    assert b.identity.is_mla and b.prefix != backend.pools.kv.prefix


def test_dsa_indexer_pages_round_trip_byte_for_byte(dsa_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, anchor, indexer = dsa_attach
    randomize(anchor, 21)
    gen = torch.Generator().manual_seed(22)
    buf = indexer.index_k_with_scale_buffer.view(-1)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    keys = hashes(3, "dsa")
    # the indexer follows the KV anchor's indices: the same slots for both
    src = slots(anchor, 1, 3)
    want_kv = [page(anchor, p) for p in (1, 2, 3)]
    want_ix = [page(indexer, p) for p in (1, 2, 3)]
    assert all(backend.batch_set_v1(keys, src))
    assert backend.batch_set_v2([transfer(PoolName.INDEXER, keys=keys, host_indices=src)]) == {
        PoolName.INDEXER: [True] * 3
    }

    randomize(anchor, 23)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    dst = slots(anchor, 4, 3)
    assert all(backend.batch_get_v1(keys, dst))
    assert backend.batch_get_v2([transfer(PoolName.INDEXER, keys=keys, host_indices=dst)]) == {
        PoolName.INDEXER: [True] * 3
    }
    for i, p in enumerate((4, 5, 6)):
        assert torch.equal(page(anchor, p), want_kv[i])
        assert torch.equal(page(indexer, p), want_ix[i])
    assert backend.stats()["errors"] == {}


def test_a_hole_in_the_dsa_indexer_cuts_the_hit_there(dsa_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    backend, anchor, indexer = dsa_attach
    keys = hashes(4, "dsa-hole")
    assert all(backend.batch_set_v1(keys, slots(anchor, 0, 4)))
    # indexer pages 0, 1 and 3 stored, page 2 missing: "1101"
    held = [keys[0], keys[1], keys[3]]
    idx = torch.cat([slots(anchor, 0, 2), slots(anchor, 3, 1)])
    assert backend.batch_set_v2([transfer(PoolName.INDEXER, keys=held, host_indices=idx)]) == {
        PoolName.INDEXER: [True] * 3
    }
    query = transfer(PoolName.INDEXER, keys=None, policy=PoolHitPolicy.ALL_PAGES)
    # ALL_PAGES: prefix p is restorable iff pages [0, p) all exist -> 1 and 2;
    # page 3 does not help past the hole; KV alone would give 4
    assert result(backend.batch_exists_v2(keys, [query])) == (2, {"kv": 4, "indexer": 2}, [1, 2])
    # the hole filled: every prefix
    assert all(backend.batch_set_v2([transfer(PoolName.INDEXER, keys=keys[2:3], host_indices=slots(anchor, 2, 1))])[
        PoolName.INDEXER
    ])
    assert result(backend.batch_exists_v2(keys, [query])) == (4, {"kv": 4, "indexer": 4}, [1, 2, 3, 4])


# ------------------------------------------------------------- refusals


def test_the_legacy_key_scheme_refuses_side_pools_at_attach(attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, kv = attach(tiny(), tokens=32, extra={"key_scheme": "legacy"})
    backend.register_mem_host_pool_v2(kv, PoolName.KV)  # the anchor is fine
    with pytest.raises(UnsupportedPoolError, match="hybrid side pool 'mamba' has no in-tree key"):
        backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
    assert backend.pools.side == {}


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(
            lambda: kv_side_pool(tiny(layer_num=1), layout="layer_first"), "layout 'layer_first'",
            id="layer_first",
        ),
        pytest.param(
            lambda: SimpleNamespace(page_size=4, size=64, layout="page_first", kv_buffer=None,
                                    get_page_buffer_meta=lambda idx: ([], [])),
            "no host buffers", id="logical-pool",
        ),
        pytest.param(
            lambda: SimpleNamespace(page_size=4, size=64, layout="page_first", kv_buffer=torch.zeros(8)),
            "no get_page_buffer_meta", id="not-page-addressable",
        ),
    ],
)
def test_unsupported_pools_are_refused_at_registration(hybrid_attach, make, match):
    backend, _ = hybrid_attach(side=())
    pool = make()
    before = region_count()
    with pytest.raises(UnsupportedPoolError, match=match):
        backend.register_mem_host_pool_v2(pool, "swa")
    assert backend.pools.side == {} and region_count() == before


def test_a_refused_pool_leaves_what_was_bound_untouched(hybrid_attach):
    import re

    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("draft",))
    binding = backend.pools.side["draft"]
    before = region_count()
    want = "hybrid pool 'swa' (MHATokenToKVPoolHost) uses layout 'layer_first'"
    with pytest.raises(UnsupportedPoolError, match=re.escape(want)):
        backend.register_mem_host_pool_v2(kv_side_pool(tiny(layer_num=1), layout="layer_first"), PoolName.SWA)
    # nothing of it stays registered; what was bound before is untouched
    assert list(backend.pools.side) == ["draft"] and backend.pools.side["draft"] is binding
    assert region_count() == before
    assert backend.batch_get_v2([transfer(PoolName.SWA, keys=hashes(1), host_indices=torch.arange(4))]) == {
        PoolName.SWA: [False]
    }


# ------------------------------------------------------------- never raise


def test_data_path_faults_are_misses_of_the_right_length(hybrid_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("swa", "mamba"))
    s = Seeded(backend, pools)
    s.store("kv", "111111")
    s.store("swa", "111111")
    swa = pools["swa"]
    t = [
        transfer(PoolName.SWA, keys=s.keys[:3], host_indices=slots(swa, 0, 3)),
        transfer(PoolName.MAMBA, keys=s.keys[:2], host_indices=torch.tensor([0, 1])),
    ]

    def boom(*_):
        raise RuntimeError("network down")

    for name in ("mget", "mexists", "mput", "mget_views", "mexists_codes", "mput_views"):
        setattr(backend.client, name, boom)
    assert backend.batch_get_v2(t) == {PoolName.SWA: [False] * 3, PoolName.MAMBA: [False] * 2}
    assert backend.batch_set_v2(t) == {PoolName.SWA: [False] * 3, PoolName.MAMBA: [False] * 2}
    assert result(s.query(swa_query(1))) == (0, {}, [])
    assert backend.stats()["errors"]["exception:RuntimeError"] >= 3


def test_bad_transfers_miss_without_touching_other_pools(hybrid_attach):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, pools = hybrid_attach(side=("swa", "mamba"))
    s = Seeded(backend, pools)
    s.store("swa", "111000")
    swa = pools["swa"]
    got = backend.batch_get_v2([
        transfer(PoolName.SWA, keys=s.keys[:3], host_indices=slots(swa, 0, 2)),  # too few slots
        transfer(PoolName.MAMBA, keys=s.keys[:1], host_indices=None),
    ])
    assert got == {PoolName.SWA: [False] * 3, PoolName.MAMBA: [False]}
    misaligned = backend.batch_get_v2([transfer(PoolName.SWA, keys=s.keys[:1], host_indices=slots(swa, 0, 1) + 1)])
    assert misaligned == {PoolName.SWA: [False]}
    assert backend.batch_get_v2([transfer(PoolName.SWA, keys=[], host_indices=None)]) == {PoolName.SWA: []}
    ok = backend.batch_get_v2([transfer(PoolName.SWA, keys=s.keys[:3], host_indices=slots(swa, 4, 3))])
    assert ok == {PoolName.SWA: [True] * 3}
    assert backend.batch_get_v2([]) == {} and backend.batch_set_v2(None) == {}
    assert result(backend.batch_exists_v2([], [mamba_query()])) == (0, {}, [])


# ------------------------------------------------------------- lifecycle


def test_close_releases_every_region_and_clear_removes_side_objects(hybrid_attach, store_name):
    from sglang_simm.local_store import get_server

    backend, pools = hybrid_attach()
    s = Seeded(backend, pools)
    s.store("kv", "111111")
    s.store("mamba", "111111")
    s.store("draft", "111111")
    server = get_server(store_name)
    assert len(server) > 0
    backend.clear()
    assert len(server) == 0
    assert result(s.query(mamba_query())) == (0, {}, [])
    before = region_count()
    regions = 1 + sum(len(b.mrs) for b in backend.pools.side.values())
    backend.close()
    assert region_count() == before - regions
    assert backend.pools.side == {}


# ------------------------------------------------------------------ demo


def test_the_hybrid_demo_preset_restores_states_and_pages(store_name, tmp_path, capsys):
    import json

    from sglang_simm_dev.cli import main

    out = tmp_path / "hybrid.json"
    code = main(["demo", "--model", "tiny-hybrid", "--pages", "12", "--manager", f"local://{store_name}",
                 "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["ok"] and result["verified_bytes"] == result["expected_verified_bytes"]
    assert [p["hits"] for p in result["phases"] if p["kind"] == "read"] == [12, 8]
    from sglang_simm.local_store import server_names

    assert store_name not in server_names()  # the demo removed the store it made


def test_hybrid_presets_are_listed_with_the_others(capsys, monkeypatch):
    from sglang_simm_dev.cli import main

    monkeypatch.setenv("COLUMNS", "240")  # rich shortens cells on a narrow console

    assert main(["demo", "--list-models"]) == 0
    listed = capsys.readouterr().out
    assert "qwen3-next-tp4" in listed and "tiny-hybrid" in listed
