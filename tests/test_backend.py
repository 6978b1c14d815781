"""The v1 zero-copy data path over real SGLang host pools and the local store."""

from __future__ import annotations

import threading

import pytest
import torch

from pages import fill_random, hashes, page, raw, slots, tiny, tiny_mla
from sglang_simm import errors
from sglang_simm.local_store import get_server
from sglang_simm_dev.faults import configure_faults


CASES = [
    pytest.param(tiny(), "page_first", id="mha-page_first-bf16"),
    pytest.param(tiny(), "page_first_direct", id="mha-page_first_direct-bf16"),
    pytest.param(tiny(), "page_head", id="mha-page_head-bf16"),
    pytest.param(tiny(dtype=torch.float16, page_size=1), "page_first", id="mha-page1-fp16"),
    pytest.param(tiny(dtype=torch.float32, page_size=16, head_num=1), "page_first_direct", id="mha-page16-fp32"),
    pytest.param(tiny(dtype=torch.float8_e4m3fn), "page_first", id="mha-fp8"),
    pytest.param(tiny_mla(), "page_first", id="mla-page_first-bf16"),
    pytest.param(tiny_mla(page_size=8, dtype=torch.float16), "page_first_direct", id="mla-page_first_direct-fp16"),
]


@pytest.mark.parametrize("geom, layout", CASES)
@pytest.mark.parametrize("route", ["simm", "dynamic"])
def test_pages_round_trip_byte_for_byte_into_fresh_slots(attach, geom, layout, route):
    backend, host = attach(geom, layout=layout, route=route)
    fill_random(host, seed=1)
    keys = hashes(4)
    written = [page(host, p) for p in range(1, 5)]
    assert backend.batch_set_v1(keys, slots(host, 1, 4)) == [True] * 4
    assert backend.batch_exists(keys) == 4

    fill_random(host, seed=2)  # the host pool forgets everything
    before = raw(host)
    assert backend.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    for i in range(4):
        assert torch.equal(page(host, 8 + i), written[i]), f"page {i} differs"
    # nothing outside pages 8..11 changed
    after = raw(host)
    changed = torch.nonzero(after != before).flatten()
    lo, hi = _page_byte_span(host, 8, 4)
    assert changed.numel() > 0 and all(any(a <= int(c) < b for a, b in zip(lo, hi)) for c in changed[:: max(1, changed.numel() // 200)])
    assert backend.stats()["pages_read"] == 4 and backend.stats()["errors"] == {}


def _page_byte_span(host, first_page: int, n: int):
    """Byte ranges of the pool buffer that pages [first, first+n) occupy."""
    ptrs, sizes = host.get_page_buffer_meta(slots(host, first_page, n))
    base = host.kv_buffer.data_ptr()
    return [p - base for p in ptrs], [p - base + s for p, s in zip(ptrs, sizes)]


@pytest.mark.parametrize("tp_rank", [0, 1, 3])
def test_each_tp_rank_round_trips_its_own_pages(attach, tp_rank):
    backend, host = attach(tiny(), tp_rank=tp_rank, tp_size=4)
    fill_random(host, seed=tp_rank)
    keys = hashes(3)
    want = [page(host, p) for p in range(3)]
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    fill_random(host, seed=99)
    assert all(backend.batch_get_v1(keys, slots(host, 0, 3)))
    assert all(torch.equal(page(host, p), want[p]) for p in range(3))


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "another-model"},
        {"tp_size": 2},
        {"tp_rank": 1},
        {"extra": {"extra_backend_tag": "other-tenant"}},
    ],
    ids=["model", "tp-size", "tp-rank", "tag"],
)
def test_backends_differing_in_identity_never_see_each_others_pages(attach, change):
    writer, whost = attach(tiny())
    fill_random(whost, 3)
    keys = hashes(4)
    assert all(writer.batch_set_v1(keys, slots(whost, 0, 4)))
    fields = dict(change)
    reader, rhost = attach(tiny(), **fields)
    before = raw(rhost)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, slots(rhost, 0, 4)) == [False] * 4
    assert torch.equal(raw(rhost), before)


@pytest.mark.parametrize(
    "geom",
    [tiny(page_size=8), tiny(dtype=torch.float16), tiny(head_dim=8)],
    ids=["page-size", "dtype", "head-dim"],
)
def test_geometry_or_dtype_mismatch_is_a_miss(attach, geom):
    writer, whost = attach(tiny())
    fill_random(whost, 4)
    keys = hashes(2)
    assert all(writer.batch_set_v1(keys, slots(whost, 0, 2)))
    reader, rhost = attach(geom)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, slots(rhost, 0, 2)) == [False, False]


def test_layouts_with_different_byte_orders_do_not_share_pages(attach):
    writer, whost = attach(tiny(), layout="page_first")
    fill_random(whost, 5)
    keys = hashes(2)
    assert all(writer.batch_set_v1(keys, slots(whost, 0, 2)))
    reader, _ = attach(tiny(), layout="page_first_direct")
    assert reader.batch_exists(keys) == 0


def test_mla_pages_are_shared_across_tp_ranks(attach):
    writer, whost = attach(tiny_mla(), tp_rank=0, tp_size=2)
    fill_random(whost, 6)
    keys = hashes(3)
    want = [page(whost, p) for p in range(3)]
    assert all(writer.batch_set_v1(keys, slots(whost, 0, 3)))
    reader, rhost = attach(tiny_mla(), tp_rank=1, tp_size=2)
    assert reader.batch_exists(keys) == 3
    assert all(reader.batch_get_v1(keys, slots(rhost, 4, 3)))
    assert all(torch.equal(page(rhost, 4 + i), want[i]) for i in range(3))


@pytest.mark.parametrize("release", ["head", "v0.1.0.post1"])
def test_a_write_is_one_put_and_pages_already_stored_keep_their_bytes(attach, store_name, release):
    """No lookup before a zero-copy write: serving's backups are new pages.
    A page stored before is put again; HEAD's mput overwrites it with the
    same bytes, the tag's keeps it (DataServerDataAlreadyExists, counted as
    stored before); either way every page reads back right."""
    backend, host = attach(tiny(), extra={"client_flags": {"local_store_simm_release": release}})
    fill_random(host, 7)
    keys = hashes(4)
    want = [page(host, p) for p in range(4)]
    assert all(backend.batch_set_v1(keys[:2], slots(host, 0, 2)))
    server = get_server(store_name)
    before = server.stats()
    looked_up = []
    backend.client.mexists = lambda obj_keys: looked_up.append(obj_keys) or [False] * len(obj_keys)
    backend.client.mexists_codes = lambda obj_keys: looked_up.append(obj_keys) or [1] * len(obj_keys)
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    after = server.stats()
    # one mput of every object: HEAD stores all 8 again, the tag the 4 new
    assert after["puts"] - before["puts"] == (8 if release == "head" else 4)
    assert looked_up == []  # and no mexists before it
    stats = backend.stats()
    assert stats["pages_written"] + stats["pages_skipped_existing"] == 6 and stats["errors"] == {}
    assert stats["pages_skipped_existing"] == (2 if release != "head" else 0)
    fill_random(host, 8)
    assert backend.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    assert all(torch.equal(page(host, 8 + p), want[p]) for p in range(4))


def test_exists_counts_only_the_leading_complete_pages(attach, store_name):
    backend, host = attach(tiny())
    fill_random(host, 8)
    keys = hashes(5)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 5)))
    server = get_server(store_name)
    v_key = next(k for k in server.keys() if keys[2] in k and k.endswith(".v"))
    server.delete(v_key)  # page 2 loses its V half
    assert backend.batch_exists(keys) == 2
    fill_random(host, 9)
    got = backend.batch_get_v1(keys, slots(host, 0, 5))
    assert got == [True, True, False, True, True]  # a half page never counts as read


def test_object_of_the_wrong_size_is_a_miss(attach, store_name):
    backend, host = attach(tiny())
    fill_random(host, 10)
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    server = get_server(store_name)
    k_key = next(k for k in server.keys() if keys[1] in k and k.endswith(".k"))
    from sglang_simm.local_store import Store, set_flag

    set_flag("cm_primary_node_ip", store_name)
    store = Store()
    short = store.allocate(16)
    assert store.put(k_key, short.view()) == 0  # sync put overwrites
    assert backend.batch_get_v1(keys, slots(host, 4, 2)) == [True, False]
    assert backend.stats()["errors"].get("size_mismatch") == 1


def test_eviction_between_exists_and_get_gives_a_correct_prefix(attach, store_name):
    backend, host = attach(tiny())
    fill_random(host, 11)
    keys = hashes(6)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 6)))
    assert backend.batch_exists(keys) == 6
    server = get_server(store_name)
    for k in [k for k in server.keys() if keys[3] in k]:
        server.delete(k)
    got = backend.batch_get_v1(keys, slots(host, 8, 6))
    assert got[:3] == [True] * 3 and got[3] is False


def test_get_object_failed_is_a_miss_when_absent_and_a_fault_when_present(attach, store_name, caplog):
    """The synchronous client answers GetObjectFailed for every server-side
    get failure, an absent key included. Absent (evicted since SGLang's
    exists query, or never stored): a miss, not an error. Present (here an
    object longer than its view, which SiMM HEAD's server refuses): a fault,
    counted under its own code and logged at most once per interval."""
    import logging

    backend, host = attach(tiny())
    fill_random(host, 23)
    keys = hashes(3)
    assert all(backend.batch_set_v1(keys[:2], slots(host, 0, 2)))
    with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
        assert backend.batch_get_v1(keys, slots(host, 4, 3)) == [True, True, False]  # never stored
        server = get_server(store_name)
        for k in [k for k in server.keys() if keys[1] in k]:
            server.delete(k)  # evicted between exists and get
        assert backend.batch_get_v1(keys[:2], slots(host, 4, 2)) == [True, False]
    assert backend.stats()["errors"] == {}
    assert not caplog.records

    from sglang_simm.local_store import Store, set_flag

    k_key = next(k for k in server.keys() if keys[0] in k and k.endswith(".k"))
    set_flag("cm_primary_node_ip", store_name)
    store = Store()
    long = store.allocate(backend.pools.kv.sizes_list[0] + 64)
    assert store.put(k_key, long.view()) == 0
    with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
        for _ in range(5):
            assert backend.batch_get_v1(keys[:1], slots(host, 4, 1)) == [False]
    assert backend.stats()["errors"] == {errors.code_name(errors.GET_OBJECT_FAILED): 5}
    warned = [r for r in caplog.records if "GetObjectFailed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


@pytest.mark.parametrize(
    "faults, expect_codes",
    [
        ({"error_rate": 1.0}, True),
        ({"down": True}, True),
        ({"latency_us": 2000}, False),
    ],
    ids=["errors", "down", "latency"],
)
def test_faults_become_misses_never_exceptions(attach, store_name, faults, expect_codes):
    backend, host = attach(tiny())
    fill_random(host, 12)
    keys = hashes(4)
    assert all(backend.batch_set_v1(keys[:2], slots(host, 0, 2)))
    configure_faults(store_name, **faults)
    try:
        got_set = backend.batch_set_v1(keys, slots(host, 0, 4))
        got_exists = backend.batch_exists(keys)
        got_get = backend.batch_get_v1(keys, slots(host, 8, 4))
    finally:
        configure_faults(store_name, error_rate=0.0, down=False, latency_us=0)
    if expect_codes:
        assert got_get == [False] * 4
        assert got_exists == 0
        assert got_set[2:] == [False, False]
        assert backend.stats()["errors"], "faults must be counted"
    else:
        assert got_set == [True] * 4 and got_exists == 4 and got_get == [True] * 4


def test_client_exceptions_are_caught_counted_and_answered_as_misses(attach):
    backend, host = attach(tiny())

    def boom(*a, **k):
        raise RuntimeError("native client exploded")

    for name in ("mget", "mexists", "mput", "mget_views", "mexists_codes", "mput_views"):
        setattr(backend.client, name, boom)
    keys = hashes(3)
    assert backend.batch_get_v1(keys, slots(host, 0, 3)) == [False] * 3
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, slots(host, 0, 3)) == [False] * 3
    assert backend.stats()["errors"]["exception:RuntimeError"] == 3


@pytest.mark.parametrize(
    "keys, indices, stored_leading",
    [
        ([], torch.arange(0), 0),
        (hashes(2), torch.arange(0, 3), 1),  # fewer slots than pages
        (hashes(2), torch.arange(2, 10), 1),  # not page-aligned
        (hashes(1), torch.tensor([4, 5, 7, 6]), 1),  # scrambled page
        (hashes(1), torch.tensor([4, 6, 5, 7]), 1),  # first and last slot right, reordered inside
        (hashes(2), torch.arange(10_000, 10_008), 1),  # outside the pool
        ([None, 5], torch.arange(0, 8), 0),  # not strings
        (["x" * 300, hashes(1)[0]], torch.arange(0, 8), 0),  # key over SiMM's limit
    ],
    ids=["empty", "short", "misaligned", "scrambled", "reordered-inside", "outside", "non-str", "too-long"],
)
def test_bad_inputs_never_raise_and_never_touch_the_pool(attach, keys, indices, stored_leading):
    backend, host = attach(tiny())
    fill_random(host, 13)
    good = hashes(1)[0]  # the first page of every hashes(n) list below
    assert backend.batch_set_v1([good], torch.arange(0, 4)) == [True]
    before = raw(host)
    got = backend.batch_get_v1(keys, indices)
    assert len(got) == len(keys)
    if keys and keys[0] == "x" * 300:
        assert got == [False, True]  # the good page still loads
    else:
        assert not any(got)
        assert torch.equal(raw(host), before)
    assert len(backend.batch_set_v1(keys, indices)) == len(keys)
    assert backend.batch_exists(keys) == stored_leading


@pytest.mark.parametrize("pages", [2, 80], ids=["small", "large"])
def test_a_batch_naming_one_host_page_twice_is_refused_and_counted(attach, pages):
    """Two page keys on the same host slots: a read would load both pages
    into one place and answer True for both, a write would store one
    page's bytes under the other's key. Both miss, counted, pool untouched."""
    backend, host = attach(tiny(), tokens=96 * tiny().page_size)
    fill_random(host, 21)
    keys = hashes(pages)
    assert all(backend.batch_set_v1(keys, slots(host, 0, pages)))
    before = raw(host)
    twice = slots(host, 100, pages)
    twice[-host.page_size:] = slots(host, 100, 1)  # the last page on the first page's slots
    assert backend.batch_get_v1(keys, twice) == [False] * pages
    assert torch.equal(raw(host), before)
    other = hashes(pages, salt="twice")
    assert backend.batch_set_v1(other, twice) == [False] * pages
    assert backend.batch_exists(other) == 0  # nothing was stored under the new keys
    assert backend.stats()["errors"]["bad_indices"] == 2


def test_concurrent_prefetch_and_backup_threads_keep_every_page_intact(attach):
    backend, host = attach(tiny(), tokens=128)
    fill_random(host, 14)
    n_pages = host.size // host.page_size
    half = n_pages // 2
    keys = hashes(half, salt="c")
    want = [page(host, p) for p in range(half)]
    errors_seen = []

    def backup(lo, hi):
        for i in range(lo, hi, 4):
            j = min(hi, i + 4)
            if not all(backend.batch_set_v1(keys[i:j], slots(host, i, j - i))):
                errors_seen.append(("set", i))

    def prefetch(lo, hi):
        for _ in range(3):
            for i in range(lo, hi, 4):
                j = min(hi, i + 4)
                n = backend.batch_exists(keys[i:j])
                if n:
                    got = backend.batch_get_v1(keys[i:i + n], slots(host, half + i, n))
                    if not all(got):
                        errors_seen.append(("get", i))

    threads = [threading.Thread(target=backup, args=(0, half // 2)), threading.Thread(target=backup, args=(half // 2, half)),
               threading.Thread(target=prefetch, args=(0, half)), threading.Thread(target=prefetch, args=(0, half))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors_seen == []
    assert all(backend.batch_get_v1(keys, slots(host, half, half)))
    for i in range(half):
        assert torch.equal(page(host, half + i), want[i]), f"page {i} torn"


def test_legacy_copying_path_round_trips_with_the_same_objects(attach):
    backend, host = attach(tiny())
    fill_random(host, 15)
    keys = hashes(3)
    values = [host.get_data_page(p * host.page_size, flat=True) for p in range(3)]
    assert backend.batch_set(keys, values) is True
    assert backend.batch_exists(keys) == 3  # v1 sees what the copying path wrote
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, targets)
    assert all(g is not None for g in got)
    assert all(torch.equal(g.view(torch.uint8), v.contiguous().view(torch.uint8)) for g, v in zip(got, values))
    assert backend.exists(keys[0]) and not backend.exists(hashes(1, salt="nope")[0])
    assert backend.get(hashes(1, salt="nope")[0], host.get_dummy_flat_data_page()) is None


def test_copying_path_writes_like_v1_only_the_missing_objects(attach, store_name):
    backend, host = attach(tiny())
    fill_random(host, 21)
    keys = hashes(4)
    assert all(backend.batch_set_v1(keys[:2], slots(host, 0, 2)))
    puts_before = get_server(store_name).stats()["puts"]
    values = [host.get_data_page(p * host.page_size, flat=True) for p in range(4)]
    assert backend.batch_set(keys, values) is True
    assert get_server(store_name).stats()["puts"] - puts_before == 2 * 2  # K and V of the 2 new pages
    stats = backend.stats()
    assert stats["pages_written"] == 2 + 2 and stats["pages_skipped_existing"] == 2
    assert stats["bytes_written"] == 4 * values[0].numel() * values[0].element_size()
    assert backend.batch_exists(keys) == 4


def test_copying_path_failed_puts_are_counted_by_code(attach, store_name):
    backend, host = attach(tiny())
    fill_random(host, 22)
    values = [host.get_data_page(0, flat=True)]
    configure_faults(store_name, error_rate=1.0)
    try:
        assert backend.batch_set(hashes(1), values) is False
    finally:
        configure_faults(store_name, error_rate=0.0)
    assert backend.stats()["errors"] and backend.stats()["pages_write_failed"] == 1


def test_get_stats_returns_sglangs_storage_metrics_drained_per_call(attach):
    from sglang_simm.metrics import storage_metrics_class

    backend, host = attach(tiny(), enable_storage_metrics=True)
    fill_random(host, 16)
    keys = hashes(3)
    backend.batch_set_v1(keys, slots(host, 0, 3))
    backend.batch_get_v1(keys, slots(host, 4, 3))
    metrics = backend.get_stats()
    assert isinstance(metrics, storage_metrics_class())
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert len(metrics.prefetch_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    again = backend.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []


def test_with_sglangs_default_metrics_off_nothing_waits_for_get_stats(attach):
    """SGLang calls get_stats() only with --enable-metrics (off by default):
    then nothing may pile up for it, however long the server runs."""
    backend, host = attach(tiny())
    assert backend.storage_config.enable_storage_metrics is False  # SGLang's default
    fill_random(host, 40)
    keys = hashes(2)
    assert backend.batch_set_v1(keys, slots(host, 0, 2)) == [True, True]
    for _ in range(3000):
        backend.batch_get_v1(keys, slots(host, 4, 2))
    backend.batch_set_v1(hashes(2, salt="more"), slots(host, 0, 2))
    assert backend.counters.pending == 0
    stats = backend.stats()  # our own counters still count
    assert stats["pages_read"] == 6000 and stats["pages_written"] == 4


def test_metrics_on_but_never_drained_stay_bounded(attach):
    from sglang_simm.metrics import PENDING_LIMIT

    backend, host = attach(tiny(), enable_storage_metrics=True)
    fill_random(host, 41)
    keys = hashes(1)
    assert backend.batch_set_v1(keys, slots(host, 0, 1)) == [True]
    for _ in range(PENDING_LIMIT + 300):
        backend.batch_get_v1(keys, slots(host, 4, 1))
    assert backend.counters.pending == PENDING_LIMIT + 1  # the newest gets, and the one set
    metrics = backend.get_stats()
    assert metrics.prefetch_pgs == [1] * PENDING_LIMIT and metrics.backup_pgs == [1]
    assert backend.counters.pending == 0


def test_clear_removes_only_this_namespace(attach, store_name):
    a, ahost = attach(tiny())
    b, bhost = attach(tiny(), model_name="other")
    fill_random(ahost, 17)
    keys = hashes(2)
    a.batch_set_v1(keys, slots(ahost, 0, 2))
    b.batch_set_v1(keys, slots(bhost, 0, 2))
    a.clear()
    assert a.batch_exists(keys) == 0 and b.batch_exists(keys) == 2


def test_close_deregisters_and_later_calls_are_misses(attach):
    backend, host = attach(tiny())
    keys = hashes(1)
    backend.close()
    backend.close()  # idempotent
    assert backend.batch_get_v1(keys, slots(host, 0, 1)) == [False]


def test_layer_first_is_refused_at_attach_naming_the_flag(attach):
    from sglang_simm.errors import UnsupportedPoolError

    with pytest.raises(UnsupportedPoolError, match="--hicache-mem-layout page_first"):
        attach(tiny(), layout="layer_first")


def test_unreachable_store_fails_attach_naming_address_and_doctor(attach, store_name):
    configure_faults(store_name, down=True)
    try:
        with pytest.raises(errors.ClusterUnreachableError, match="doctor") as info:
            attach(tiny())
        assert store_name in str(info.value)
    finally:
        configure_faults(store_name, down=False)


def test_bad_config_fails_attach_naming_the_field(attach):
    with pytest.raises(ValueError, match="clnt_threadpool_size"):
        attach(tiny(), extra={"clnt_threadpool_size": -3})


def test_dynamic_route_without_interface_v1_warns_with_the_fix(store_name, caplog):
    from sglang_simm.backend import HiCacheSiMM
    from sglang_simm_dev.pools import storage_config

    cfg = storage_config(extra_config={"manager_address": f"local://{store_name}"})
    backend = HiCacheSiMM(cfg, {})
    backend.close()
    assert any('"interface_v1": 1' in r.getMessage() for r in caplog.records)


def test_head_groups_let_different_tp_sizes_share_pages(attach):
    """page_head with tp_lcm_size 2: a TP-1 rank splits its 4 heads in 2
    groups; TP-2 ranks each hold one group. Both name the same objects."""
    one, host1 = attach(tiny(head_num=4), layout="page_head", tp_size=1, tp_rank=0,
                        tp_lcm_size=2, should_split_heads=True)
    fill_random(host1, 18)
    keys = hashes(2)
    assert all(one.batch_set_v1(keys, slots(host1, 0, 2)))
    full = [page(host1, p) for p in range(2)]
    for rank in (0, 1):
        part, host2 = attach(tiny(head_num=2), layout="page_head", tp_size=2, tp_rank=rank,
                             tp_lcm_size=2, should_split_heads=False)
        assert part.batch_exists(keys) == 2
        assert all(part.batch_get_v1(keys, slots(host2, 0, 2)))
        for p in range(2):
            got = page(host2, p).view(2, -1)  # K, V of this rank's 2 heads
            want = full[p].view(2, 2, -1)[:, rank]  # K, V of head group `rank`
            assert torch.equal(got, want)


def test_copying_path_stores_head_groups_that_other_tp_sizes_read(attach):
    """The copying path's flat page is SGLang's ``get_data_page``: K of every
    head, then V of every head. With tp_lcm_size 2, the TP-1 rank's page is
    objects K0, V0, K1, V1 (head groups 0 and 1), which lie in that flat
    page at K0, K1, V0, V1. TP-2 ranks read their group through v1 and
    through the copying path."""
    one, host1 = attach(tiny(head_num=4), layout="page_head", tp_size=1, tp_rank=0,
                        tp_lcm_size=2, should_split_heads=True)
    fill_random(host1, 25)
    keys = hashes(2)
    values = [host1.get_data_page(p * host1.page_size, flat=True) for p in range(2)]
    full = [page(host1, p) for p in range(2)]
    assert one.batch_set(keys, values) is True
    back = one.batch_get(keys, [host1.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(back[p].view(torch.uint8), full[p]) for p in range(2))
    for rank in (0, 1):
        part, host2 = attach(tiny(head_num=2), layout="page_head", tp_size=2, tp_rank=rank,
                             tp_lcm_size=2, should_split_heads=False)
        want = [full[p].view(2, 2, -1)[:, rank].reshape(-1) for p in range(2)]  # K, V of group `rank`
        assert all(part.batch_get_v1(keys, slots(host2, 0, 2)))
        assert all(torch.equal(page(host2, p), want[p]) for p in range(2))
        got = part.batch_get(keys, [host2.get_dummy_flat_data_page() for _ in keys])
        assert all(torch.equal(got[p].view(torch.uint8), want[p]) for p in range(2))


def test_reads_after_lookups_load_each_pages_own_bytes_whatever_was_looked_up(attach):
    """SGLang's prefetch thread looks a batch up, then its I/O thread reads
    the same batch, or its first pages after the hit all-reduce, while other
    lookups (other requests, a shared prefix) come in between: every read
    loads each page's own bytes, whatever was looked up before it."""
    backend, host = attach(tiny())
    fill_random(host, 3)
    keys = hashes(6)
    want = [page(host, p) for p in range(6)]
    assert backend.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6

    def read(batch, first_slot_page=8):
        fill_random(host, 4)
        got = backend.batch_get_v1(batch, slots(host, first_slot_page, len(batch)))
        return got, [page(host, first_slot_page + i) for i in range(len(batch))]

    cases = [
        (keys, keys, list(range(6))),  # the batch looked up
        (keys, keys[:4], list(range(4))),  # its first pages (the hit all-reduce cut it)
        (keys, [keys[0], keys[5]], [0, 5]),  # the same first page, other pages
        ([keys[0], keys[4], keys[5]], keys[:3], [0, 1, 2]),  # another lookup of the same first page
        (keys[3:], keys[:3], [0, 1, 2]),  # a lookup of other pages only
    ]
    for looked_up, batch, pages in cases:
        assert backend.batch_exists(looked_up) == len(looked_up)
        assert backend.batch_exists(looked_up) == len(looked_up)  # two requests sharing a prefix
        got, loaded = read(batch)
        assert got == [True] * len(batch), (looked_up, batch)
        assert all(torch.equal(loaded[i], want[p]) for i, p in enumerate(pages)), (looked_up, batch)
        got, loaded = read(batch)  # read again, nothing looked up in between
        assert got == [True] * len(batch)
        assert all(torch.equal(loaded[i], want[p]) for i, p in enumerate(pages))


def test_non_ascii_page_keys_round_trip_beside_other_batches_lookups(attach):
    backend, host = attach(tiny())
    fill_random(host, 19)
    keys = hashes(3) + ["页面-ключ-ü"]  # a non-ASCII page key within the byte budget
    want = [page(host, p) for p in range(4)]
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    for _ in range(2):
        assert backend.batch_exists(keys) == 4
        assert backend.batch_exists(hashes(2, salt="other") + keys) == 0
        fill_random(host, 20)
        assert backend.batch_get_v1(keys, slots(host, 4, 4)) == [True] * 4
        assert all(torch.equal(page(host, 4 + i), want[i]) for i in range(4))


@pytest.mark.parametrize("pages", [1, 3], ids=["one-page", "three-pages"])
def test_host_indices_of_any_tensor_form_load_only_the_right_slots(attach, pages):
    """Host indices come as int64 or int32, whole tensors, slices of larger
    ones or strided views: a batch is written and read exactly where its
    indices point, and indices that are not whole, aligned, distinct pages
    inside the pool are refused (nothing stored, the pool untouched)."""
    backend, host = attach(tiny())
    ps, slots_total = host.page_size, backend.pools.kv.slots
    whole = torch.arange(0, 8 * ps, dtype=torch.int64)
    good = {
        "a slice of a larger tensor": (whole[3 * ps: (3 + pages) * ps], 3),
        "int32": (whole[2 * ps: (2 + pages) * ps].to(torch.int32), 2),
        "strided view": (torch.arange(ps, (1 + pages) * ps, dtype=torch.int64).repeat_interleave(2)[::2], 1),
    }
    bad = {
        "scrambled": whole[ps: (1 + pages) * ps].flip(0),
        "misaligned": whole[ps + 1: (1 + pages) * ps + 1],
        "past the pool": torch.arange(slots_total, slots_total + pages * ps, dtype=torch.int64),
        "float": whole[: pages * ps].to(torch.float32),
    }
    for name, (indices, first) in good.items():
        fill_random(host, 31)
        want = [page(host, first + i) for i in range(pages)]
        keys = hashes(pages, name)
        assert backend.batch_set_v1(keys, indices) == [True] * pages, name
        fill_random(host, 32)
        assert backend.batch_get_v1(keys, indices) == [True] * pages, name
        assert all(torch.equal(page(host, first + i), want[i]) for i in range(pages)), name
    for name, indices in bad.items():
        before = raw(host)
        keys = hashes(pages, name)
        assert backend.batch_set_v1(keys, indices) == [False] * pages, name
        assert backend.batch_exists(keys) == 0, name
        assert backend.batch_get_v1(hashes(pages, "a slice of a larger tensor"), indices) == [False] * pages, name
        assert torch.equal(raw(host), before), name
