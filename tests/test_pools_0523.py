"""Every host pool type SGLang 0.5.23 hands a storage backend, on the backend.

Each stack is built as SGLang's hybrid pool assembler builds it and attached
as its hybrid cache controller attaches it (``sglang_simm_dev.hybrid_pools``
says how, with SGLang's file:line); each storable pool's pages are backed up as the
controller backs them up, found by ``batch_exists_v2``, then read back into
other host slots after the host memory was scrambled, and compared byte for
byte through the pool's own ``get_page_buffer_meta``.

A release without one of these classes skips the test that needs it (the
harness raises ``Missing``, naming what the release lacks).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pages import region_count
from sglang_simm_dev import hybrid_pools as pools

LAYOUTS = ("page_first", "page_first_direct")

CASES = [pytest.param(label, layout, id=f"{label}-{layout}") for label in pools.STACKS for layout in LAYOUTS]

#: storage objects SGLang's get_page_buffer_meta gives per page, per pool, in
#: the page-first layouts (None: it refuses; the controller's pages are whole)
OBJECTS_PER_PAGE = {
    "mimo-v2": {"kv": 2, "swa": 2},  # K and V, of different sizes
    "minimax-m3": {"kv": 2, "indexer": 1},
    "minimax-m3-nvfp4": {"kv": 2, "indexer": 1},  # main: layers split in two halves
    "qwen4-exp": {"kv": 2, "mamba": 3, "indexer": 1},  # mamba: temporal, conv0, conv1
    "mamba-ple": {"kv": 2, "mamba": None},  # side states: "use a whole-page backend"
    "deepseek-v4": {
        "kv": 0, "swa": 1, "deepseek_v4_c4": 1, "deepseek_v4_c4_indexer": 1, "deepseek_v4_c4_state": 1,
        "deepseek_v4_c4_indexer_state": 1, "deepseek_v4_c128": 1,
    },
    "mamba-swa": {"kv": 2, "swa": 2, "mamba": 3},
    "mla-draft-tp1": {"kv": 1, "draft": 2},
}


def needs(build, *args):
    """``build(*args)``, or skip naming what this SGLang lacks."""
    try:
        return build(*args)
    except pools.Missing as e:
        pytest.skip(str(e))


def _build(label: str, layout: str) -> pools.Stack:
    return needs(pools.STACKS[label], layout)


def _result(r):
    return r.kv_hit_pages, {str(k): v for k, v in r.extra_pool_hit_pages.items()}, r.restorable_prefix_pages


def _expected_stops(stack: pools.Stack, p: pools.Plan) -> list[int]:
    """Restorable prefix lengths: every page, or only node ends where a pool
    keeps one state per node (Mamba)."""
    if any(side.window == 1 for side in stack.sides):
        return [hi for _, hi in p.nodes]
    return list(range(1, len(p.keys) + 1))


# ------------------------------------------------------------ the harness


@pytest.mark.parametrize("label, layout", CASES)
def test_pools_are_built_as_the_assembler_builds_them(label, layout):
    """The harness itself, without a backend: each pool's page size against
    the anchor's and the objects its get_page_buffer_meta gives per page."""
    stack = _build(label, layout)
    anchor = stack.anchor
    assert pools.page_objects(anchor, pools.slots(anchor, 1)) != [] or label == "deepseek-v4"
    for side in stack.sides:
        pool = side.pool
        assert pool.layout == layout, side.name
        if side.window == 1:  # Mamba: one checkpoint slot per state
            assert pool.page_size == 1
        else:  # every page-addressed pool here pages as the anchor does
            assert pool.page_size == anchor.page_size, side.name
        if side.source is not None:  # indices from another pool: room for all its slots
            assert pool.size >= stack.pools()[side.source].size, side.name
    for name, pool in stack.pools().items():
        want = OBJECTS_PER_PAGE[label][str(name)]
        if want is None:
            with pytest.raises(NotImplementedError):
                pool.get_page_buffer_meta(pools.slots(pool, 1))
            continue
        meta = pool.get_page_buffer_meta(pools.slots(pool, 1))
        assert (len(meta[0]) if meta else 0) == want, name


class Recorder:
    """A backend that stores nothing and records what it is asked."""

    def __init__(self):
        self.v1, self.v2 = [], []

    def _v1(self, keys, host_indices, extra_info=None):
        self.v1.append((list(keys), host_indices))
        return [True] * len(keys)

    def _v2(self, transfers, extra_info=None):
        self.v2 += transfers
        return {t.name: [True] * len(t.keys) for t in transfers}

    batch_set_v1 = batch_get_v1 = _v1
    batch_set_v2 = batch_get_v2 = _v2


@pytest.mark.parametrize("label, layout", CASES)
def test_the_controllers_transfers_address_whole_pages_of_each_pool(label, layout):
    """The harness, without a backend: every transfer it sends, as the
    controller would, names whole pages of the pool it is for, which
    SGLang's own get_page_buffer_meta resolves to the expected objects."""
    stack = _build(label, layout)
    p = pools.plan(stack)
    rec = Recorder()
    pools.backup(rec, stack, p)
    pools.prefetch(rec, stack, p)
    calls = [(pools.pool_names().KV, keys, idx) for keys, idx in rec.v1]
    calls += [(t.name, t.keys, t.host_indices) for t in rec.v2]
    assert {name for name, _, _ in calls} == set(stack.pools())
    for name, keys, idx in calls:
        pool = stack.pools()[name]
        assert idx.numel() == len(keys) * pool.page_size, name
        pages = idx.view(-1, pool.page_size)
        assert (pages[:, 0] % pool.page_size == 0).all() and (pages.diff(dim=1) == 1).all(), name
        assert int(idx.max()) < pool.size, name
        want = OBJECTS_PER_PAGE[label][str(name)]
        if want is not None:
            meta = pool.get_page_buffer_meta(idx)
            assert (len(meta[0]) if meta else 0) == want * len(keys), name


# ---------------------------------------------------------- round trips


@pytest.mark.parametrize("label, layout", CASES)
def test_every_pool_round_trips_byte_for_byte(attach, label, layout):
    """Back up three pages of every pool as two nodes (two pages, then one),
    find them, read them into other slots of scrambled host memory and
    compare every byte."""
    stack = _build(label, layout)
    backend = pools.attach_stack(attach, stack)
    p = pools.plan(stack)
    pools.scramble_all(stack, 1)
    want = pools.snapshot(stack, p, "src")

    stored = pools.backup(backend, stack, p)
    for name in stack.pools():
        assert all(stored[name]) and stored[name], (name, stored.get(name))

    # the storage hit query, with the controller's PREFETCH transfers
    kv_hit, pool_hits, stops = _result(backend.batch_exists_v2(p.keys, pools.queries(stack)))
    assert kv_hit == len(p.keys) and stops == _expected_stops(stack, p), (kv_hit, pool_hits, stops)
    for side in stack.sides:
        assert pool_hits.get(str(side.name)) == len(p.keys), (side.name, pool_hits)

    pools.scramble_all(stack, 2)
    got = pools.prefetch(backend, stack, p)
    assert all(all(ok) for ok in got.values()) and set(got) == set(stack.pools()), got
    have = pools.snapshot(stack, p, "dst")
    for name in stack.pools():
        side = next((s for s in stack.sides if s.name == name), None)
        pages = [-1] if side is not None and side.window == 1 else range(len(p.keys))
        for i in pages:  # a trailing state is read for the hit's last node only
            assert have[name][i] == want[name][i], (name, i)

    # a window-1 pool's earlier node state: the hit of that node's prefix
    for side in (s for s in stack.sides if s.window == 1):
        short = pools.prefetch(backend, stack, p, pages=p.nodes[0][1])
        assert all(short[side.name]), short
        assert pools.page_objects(side.pool, p.dst[side.name][0]) == want[side.name][0]
    assert backend.stats()["errors"] == {}


# ----------------------------------------------------------------- MXFP8


def test_mxfp8_kv_is_refused_at_attach_saying_why_and_what_to_do(attach):
    """MHATokenToKVPoolMXFP8Host keeps each page's UE8M0 scales outside
    kv_buffer and exposes no storage pages (its get_page_buffer_meta
    raises): the backend must refuse it when it is attached, not at the
    first backup, and say so."""
    from sglang_simm.errors import UnsupportedPoolError

    pool = needs(pools.mxfp8_host_pool)
    with pytest.raises(NotImplementedError):
        pool.get_page_buffer_meta(pools.slots(pool, 1))
    before = region_count()
    with pytest.raises(UnsupportedPoolError) as info:
        attach(SimpleNamespace(name="tiny-mxfp8", is_mla=False, page_size=pool.page_size), pool=pool)
    message = str(info.value)
    assert "MHATokenToKVPoolMXFP8Host" in message  # which pool
    assert "scale" in message.lower()  # why: its scales are not in its pages
    assert "--kv-cache-dtype" in message  # what to do
    assert region_count() == before


# --------------------------------------------------------- MLA + MHA draft


def _tp2(attach):
    """Two ranks of one TP-2 server over one store: an MLA KV anchor
    (replicated: both ranks hold the same bytes) and an MHA draft pool
    (sharded: each rank its own heads)."""
    stacks = {rank: needs(pools.mla_with_mha_draft, rank) for rank in (0, 1)}
    backends = {rank: pools.attach_stack(attach, stacks[rank], tp_size=2, tp_rank=rank) for rank in (0, 1)}
    keys = pools.hashes(3, "mla-draft")
    plans = {rank: pools.plan(stacks[rank], keys=keys) for rank in (0, 1)}
    for rank, stack in stacks.items():
        pools.scramble_all(stack, 10 + rank)
    for a, b in zip(pools.host_tensors(stacks[0].anchor), pools.host_tensors(stacks[1].anchor)):
        b.copy_(a)  # MLA KV: the same on every rank
    return stacks, backends, plans


def test_an_mha_draft_of_an_mla_model_at_tp2_is_left_out_as_sglang_drives_it(attach):
    """SGLang backs the draft up on the MLA storage writer only (rank 0;
    ``should_backup`` is False for DRAFT on rank 1 with this backend), yet
    reads it on every rank beside the KV: rank 1's heads could never be
    stored. Both ranks leave the draft out and restore the target's KV:
    the draft is absent from every answer (no verdict, so SGLang's MIN of
    the pools' hits is the KV's), and no rank loads another rank's heads."""
    stacks, backends, plans = _tp2(attach)
    PoolName = pools.pool_names()
    assert pools.should_backup(stacks[1], writer=False, name=PoolName.DRAFT) is False  # the premise
    want = {rank: pools.snapshot(stacks[rank], plans[rank], "src") for rank in (0, 1)}
    assert want[0][PoolName.KV] == want[1][PoolName.KV]
    assert want[0][PoolName.DRAFT] != want[1][PoolName.DRAFT]

    written = pools.backup(backends[0], stacks[0], plans[0], writer=True)
    assert written == {PoolName.KV: [True] * 3}  # the draft is not written
    assert pools.backup(backends[1], stacks[1], plans[1], writer=False) == {}  # rank 1 stores nothing

    draft_query = [pools.transfer(PoolName.DRAFT, keys=None, policy=pools.hit_policies().ALL_PAGES)]
    for rank in (0, 1):
        kv_hit, hits, _ = _result(backends[rank].batch_exists_v2(plans[rank].keys, draft_query))
        assert kv_hit == 3 and "draft" not in hits, (rank, hits)
        pools.scramble_all(stacks[rank], 20 + rank)
        before = pools.snapshot(stacks[rank], plans[rank], "dst")
        got = pools.prefetch(backends[rank], stacks[rank], plans[rank])
        assert got == {PoolName.KV: [True] * 3}, rank
        have = pools.snapshot(stacks[rank], plans[rank], "dst")
        assert have[PoolName.KV] == want[0][PoolName.KV], rank
        assert have[PoolName.DRAFT] == before[PoolName.DRAFT], rank  # untouched
