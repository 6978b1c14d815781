"""Objects longer than their view (SiMM's get bound is the registered region).

SiMM's client sends the whole registered region's size as a get's bound, so
an object longer than the page's object is written past the view, over the
host pages next to it, before the backend sees the length. The local
store reproduces that with ``local_store_get_bound=region``. The backend must
count it, log it with the key, and report as misses the page and every page
of the same batch whose bytes the overrun may have reached.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pages import fill_random, hashes, page, slots, tiny, tiny_mla
from sglang_simm import local_store


@pytest.fixture
def region_bound():
    """SiMM's own get bound (the registered region) for this test only."""
    previous = local_store.get_flag("local_store_get_bound")
    assert local_store.set_flag("local_store_get_bound", "region")
    yield
    local_store.set_flag("local_store_get_bound", previous)


def _first_key(store_name: str, page_key: str) -> str:
    """The object key of ``page_key``'s first object (K, or MLA's one)."""
    keys = sorted(k for k in local_store.get_server(store_name).keys() if page_key in k)
    return next(k for k in keys if k.endswith((".k", "_k", ".kv")))


def _put_foreign(store_name: str, key: str, nbytes: int, fill: int) -> None:
    """Another writer stores ``nbytes`` under ``key`` (sync put overwrites)."""
    local_store.set_flag("cm_primary_node_ip", store_name)
    store = local_store.Store()
    block = store.allocate(nbytes)
    block.as_ref().fill_(fill)
    assert store.put(key, block.view()) == 0


LAYOUTS = [
    pytest.param(tiny(), "page_first", id="mha-page_first"),
    pytest.param(tiny(), "page_first_direct", id="mha-page_first_direct"),
    pytest.param(tiny(), "page_head", id="mha-page_head"),
    pytest.param(tiny_mla(), "page_first", id="mla-page_first"),
]


@pytest.mark.parametrize("geom, layout", LAYOUTS)
@pytest.mark.parametrize("scheme", ["namespaced", "legacy"])
def test_an_object_longer_than_its_view_voids_the_pages_it_reached(
    attach, store_name, region_bound, caplog, geom, layout, scheme
):
    backend, host = attach(geom, layout=layout, extra={"key_scheme": scheme})
    fill_random(host, 31)
    keys = hashes(4)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 4)))
    want = [page(host, p) for p in range(4)]
    first = backend.pools.kv.sizes_list[0]
    # page 1's first object, one and a half times its size: it runs into
    # the first object of the next host page (page_head: the next page's K)
    _put_foreign(store_name, _first_key(store_name, keys[1]), first * 3 // 2, 0xAB)

    fill_random(host, 32)
    with caplog.at_level(logging.ERROR, logger="sglang_simm.backend"):
        got = backend.batch_get_v1(keys, slots(host, 4, 4))
    assert got == [True, False, False, True]
    for p in (0, 3):  # what still reads True is the stored page, byte for byte
        assert torch.equal(page(host, 4 + p), want[p])
    assert backend.stats()["errors"]["get_overrun"] == 1
    record = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert keys[1] in record.getMessage() and "past the view" in record.getMessage()


def test_the_last_k_object_runs_into_the_first_pages_v(attach, store_name, region_bound):
    """page_first: K of every page, then V of every page. K of the pool's
    last page runs into V of host page 0, a page of the same batch."""
    backend, host = attach(tiny())
    fill_random(host, 33)
    keys = hashes(3)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    last = host.size // host.page_size - 1
    order = torch.cat([slots(host, last, 1), slots(host, 0, 1), slots(host, 5, 1)])
    k = backend.pools.kv.sizes_list[0]
    _put_foreign(store_name, _first_key(store_name, keys[0]), k + 16, 0xCD)
    assert backend.batch_get_v1(keys, order) == [False, False, True]


def test_an_overrun_into_memory_outside_the_batch_is_still_counted(attach, store_name, region_bound):
    """The page after the overrun holds nothing of this batch: only the
    long object's own page misses (the rest cannot be recalled)."""
    backend, host = attach(tiny())
    fill_random(host, 34)
    keys = hashes(2)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 2)))
    _put_foreign(store_name, _first_key(store_name, keys[0]), 700, 0xEF)
    order = torch.cat([slots(host, 4, 1), slots(host, 8, 1)])
    assert backend.batch_get_v1(keys, order) == [False, True]
    assert backend.stats()["errors"]["get_overrun"] == 1


def test_an_object_past_the_regions_end_fails_without_an_overrun(attach, store_name, region_bound):
    """V of the pool's last page ends the region: SiMM refuses (HEAD) or the
    NIC fails the write; either way a failed get, never written past."""
    backend, host = attach(tiny())
    fill_random(host, 35)
    keys = hashes(1)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 1)))
    v_key = next(k for k in local_store.get_server(store_name).keys() if keys[0] in k and k.endswith(".v"))
    _put_foreign(store_name, v_key, backend.pools.kv.sizes_list[1] * 2, 0x11)
    last = host.size // host.page_size - 1
    before = host.kv_buffer.view(-1).view(torch.uint8).clone()
    assert backend.batch_get_v1(keys, slots(host, last, 1)) == [False]
    assert "get_overrun" not in backend.stats()["errors"]
    # the K object read into its view, nothing outside the page changed
    after = host.kv_buffer.view(-1).view(torch.uint8)
    changed = torch.nonzero(after != before).flatten()
    k_ptr = backend.pools.kv.geometry.pointers(slots(host, last, 1)[:1].numpy())[0] - host.kv_buffer.data_ptr()
    assert changed.numel() == 0 or (changed.min() >= k_ptr and changed.max() < k_ptr + backend.pools.kv.sizes_list[0])


def test_the_copying_path_drops_the_whole_batch_on_an_overrun(attach):
    """The copying path reads into client-owned blocks, and which of them an
    overrun reached is the client's business: the whole batch misses. (The
    local store client's blocks are regions of their own, so SiMM's answer for
    a long object is played here over the real store's.)"""
    backend, host = attach(tiny())
    fill_random(host, 36)
    keys = hashes(3)
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    real_mget = backend.client.mget

    def mget_with_a_long_object(obj_keys, views):
        codes = list(real_mget(obj_keys, views))
        codes[2] += 88  # page 1's K: 88 bytes longer than its block
        return codes

    backend.client.mget = mget_with_a_long_object
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    assert backend.batch_get(keys, targets) == [None, None, None]
    assert backend.stats()["errors"]["get_overrun"] == 1


def test_legacy_keys_warn_at_attach_naming_the_risk_and_the_fix(attach, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
        attach(tiny(), extra={"key_scheme": "legacy"})
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "key_scheme 'legacy'" in text and "written past it" in text
    assert "key_scheme 'namespaced'" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_simm.backend"):
        attach(tiny())
    assert not any("written past it" in r.getMessage() for r in caplog.records)
