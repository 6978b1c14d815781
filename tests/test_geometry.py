"""Geometry fitting and index checks (pure; real pools are in the backend tests)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import derive_geometry, page_starts

PAGE = 4
STRIDE = 96  # bytes per token slot of one object


def mha_meta(base: int, tokens: int):
    v_offset = tokens * STRIDE

    def meta(indices):
        ptrs, sizes = [], []
        for i in range(0, len(indices), PAGE):
            k = base + indices[i] * STRIDE
            ptrs += [k, k + v_offset]
            sizes += [PAGE * STRIDE] * 2
        return ptrs, sizes

    return meta


def fit(meta, tokens=64, base=4096, limit=1 << 30):
    return derive_geometry(
        meta, page_size=PAGE, pool_tokens=tokens, buffer_start=base,
        buffer_bytes=2 * tokens * STRIDE, make_indices=lambda lo, hi: list(range(lo, hi)),
        value_limit=limit,
    )


def test_affine_pool_is_fitted_and_evaluated_like_the_pool():
    meta = mha_meta(4096, 64)
    g = fit(meta)
    assert g.parts == 2 and g.chunks == 1 and g.num_pages == 16
    starts = np.array([0, 12, 60])
    expected, _ = meta([s + j for s in starts for j in range(PAGE)])
    assert g.pointers(starts).tolist() == expected


def test_pointers_of_int32_slots_past_2_gib_do_not_wrap():
    """SGLang's host indices may be int32; slot * stride passes 2^31 in any
    pool over 2 GiB (here a 64 KiB-per-token pool of 1M slots)."""
    tokens, stride = 1 << 20, 64 << 10
    g = derive_geometry(
        lambda idx: ([(1 << 40) + idx[0] * stride], [PAGE * stride]), page_size=PAGE, pool_tokens=tokens,
        buffer_start=1 << 40, buffer_bytes=tokens * stride, make_indices=lambda lo, hi: list(range(lo, hi)),
    )
    starts = np.array([0, tokens - PAGE], dtype=np.int32)
    assert g.pointers(starts).tolist() == [(1 << 40) + int(s) * stride for s in starts]


def test_objects_over_the_value_limit_are_chunked_contiguously():
    g = fit(mha_meta(4096, 64), limit=PAGE * STRIDE // 3 + 1)
    assert g.chunks == 3
    assert g.sizes.sum() == 2 * PAGE * STRIDE
    ptrs = g.pointers(np.array([8]))
    # chunks of the K object tile it exactly
    assert ptrs[1] - ptrs[0] == g.sizes[0] and ptrs[2] - ptrs[1] == g.sizes[1]


def test_non_affine_pool_is_refused_with_the_flag_to_change():
    good = mha_meta(4096, 64)

    def skewed(indices):
        ptrs, sizes = good(indices)
        if indices[0] >= 60:
            ptrs = [p + 8 for p in ptrs]
        return ptrs, sizes

    with pytest.raises(UnsupportedPoolError, match="--hicache-mem-layout"):
        fit(skewed)


def test_objects_outside_the_buffer_are_refused():
    with pytest.raises(UnsupportedPoolError, match="outside"):
        fit(mha_meta(4096, 128), tokens=64)  # V offset computed for a bigger pool


@pytest.mark.parametrize(
    "indices, n, ok",
    [
        (np.arange(8, 16), 2, [8, 12]),
        (np.arange(8, 15), 2, None),
        (np.arange(9, 17), 2, None),
        (np.array([8, 9, 10, 11, 4, 5, 6, 7]), 2, [8, 4]),
        (np.array([8, 9, 11, 10]), 1, None),
        (np.array([8, 10, 9, 11]), 1, None),
        (np.arange(0, 8), 3, None),
        (np.arange(8, 16, dtype=np.int32), 2, [8, 12]),
        (np.arange(8, 16).astype(np.float64), 2, None),
    ],
    ids=["aligned", "short", "misaligned", "pages-out-of-order", "scrambled-page", "reordered-inside",
         "count-mismatch", "int32", "float"],
)
def test_page_starts_accepts_only_whole_aligned_pages(indices, n, ok):
    got = page_starts(indices, PAGE, n)
    assert (got is None) if ok is None else got.tolist() == ok


@pytest.mark.parametrize("pages", [8, 100, 3000], ids=["few", "many", "past-the-byte-compare"])
def test_page_starts_checks_every_slot_of_every_page(pages):
    order = np.random.default_rng(pages).permutation(2 * pages)[:pages]
    indices = (order[:, None] * PAGE + np.arange(PAGE)[None, :]).ravel()
    assert page_starts(indices, PAGE, pages).tolist() == (order * PAGE).tolist()
    for where in (1, pages // 2 * PAGE + 2, indices.size - 2):  # two slots of one page swapped
        bad = indices.copy()
        bad[[where, where + 1]] = bad[[where + 1, where]]
        assert page_starts(bad, PAGE, pages) is None
    shifted = indices + 1  # every page one slot off
    assert page_starts(shifted, PAGE, pages) is None


@pytest.mark.parametrize(
    "indices, n, ok",
    [
        (np.arange(8, 16, dtype=np.uint64), 2, [8, 12]),
        (np.array([8, 9, 11, 10], dtype=np.uint64), 1, None),  # a step of -1 wraps around: refused
        (np.array([8, 9, 9, 11]), 1, None),  # a slot twice
        (np.array([8, 9, 10, 12]), 1, None),  # a hole
        (np.repeat(np.arange(8, 16), 2)[::2], 2, [8, 12]),  # a strided view
        (np.arange(8, 12, dtype=np.int16), 1, [8]),
        (np.arange(0, 0), 0, []),
    ],
    ids=["uint64", "uint64-backwards", "duplicate", "hole", "strided", "int16", "empty"],
)
def test_page_starts_dtypes_views_and_holes(indices, n, ok):
    got = page_starts(indices, PAGE, n)
    assert (got is None) if ok is None else got.tolist() == ok


def test_page_starts_page_of_one_slot():
    assert page_starts(np.array([5, 3, 9]), 1, 3).tolist() == [5, 3, 9]


def test_page_starts_small_batch_after_a_large_one():
    big = np.arange(0, 5000 * PAGE)
    assert page_starts(big, PAGE, 5000).tolist() == list(range(0, 5000 * PAGE, PAGE))
    assert page_starts(np.array([4, 5, 6, 7, 0, 1, 3, 2]), PAGE, 2) is None
    assert page_starts(np.array([4, 5, 6, 7, 0, 1, 2, 3]), PAGE, 2).tolist() == [4, 0]


@pytest.mark.parametrize("pages", [2, 64, 65, 128], ids=["two", "sixty-four", "sixty-five", "a-full-batch"])
@pytest.mark.parametrize("where", ["first-last", "neighbours"])
def test_page_starts_refuses_a_page_named_twice(pages, where):
    """Two keys on the same host slots would both answer True while one page
    holds the other's bytes: the index check refuses the batch."""
    order = np.random.default_rng(pages).permutation(4 * pages)[:pages]
    i, j = (0, pages - 1) if where == "first-last" else (pages // 2 - 1, pages // 2)
    order[j] = order[i]
    indices = (order[:, None] * PAGE + np.arange(PAGE)[None, :]).ravel()
    assert page_starts(indices, PAGE, pages) is None
    order[j] = 4 * pages  # a page of its own again
    indices = (order[:, None] * PAGE + np.arange(PAGE)[None, :]).ravel()
    assert page_starts(indices, PAGE, pages).tolist() == (order * PAGE).tolist()


def _one_page_cases():
    """One-page index batches, good and bad, in every dtype SGLang may pass."""
    rng = np.random.default_rng(7)
    for dtype in (np.int64, np.int32):
        for first in (0, 8, 4 * PAGE * 1000):
            good = np.arange(first, first + PAGE, dtype=dtype)
            yield good
            for i, j in ((0, 1), (1, 2), (PAGE - 2, PAGE - 1)):
                bad = good.copy()
                bad[[i, j]] = bad[[j, i]]
                yield bad
            yield good + 1  # misaligned
            yield good - PAGE  # negative at first == 0
            hole = good.copy()
            hole[-1] += 1
            yield hole
            dup = good.copy()
            dup[1] = dup[0]
            yield dup
        yield rng.integers(0, 64, PAGE).astype(dtype)
        yield np.full(PAGE, 8, dtype=dtype)
        yield np.array([8, 9, 10, 11 + (1 << 31)], dtype=np.int64)[:PAGE]  # a lane past 32 bits


@pytest.mark.parametrize("slots", [64, 1 << 20])
def test_page_starts_of_one_page_is_its_definition(slots):
    """For every one-page case built to break the check (swapped slots,
    holes, repeats, negative and misaligned pages, a page past the pool's
    end, a lane past 32 bits; int32 as well as int64), ``page_starts``
    answers what its definition says: the first slot exactly when the
    slots are ``first .. first + PAGE - 1`` from an aligned ``first``
    inside the pool."""
    seen_ok = seen_bad = 0
    for indices in _one_page_cases():
        first = int(indices[0])
        ok = first % PAGE == 0 and 0 <= first < slots and indices.tolist() == list(range(first, first + PAGE))
        got = page_starts(indices, PAGE, 1, slots)
        assert (got.tolist() if got is not None else None) == ([first] if ok else None), indices.tolist()
        seen_ok += ok
        seen_bad += not ok
    assert seen_ok and seen_bad
