"""The local store's extent allocator, against a byte-map model."""

from __future__ import annotations

import random

import pytest

from sglang_simm.local_store._allocator import ALIGN, ExtentAllocator, aligned


def check_invariants(a: ExtentAllocator, allocated: dict[int, int]) -> None:
    """Free extents and allocations tile the arena exactly, free extents never touch."""
    spans = sorted([(s, s + aligned(n)) for s, n in allocated.items()] + [(s, s + n) for s, n in a._start_len.items()])
    pos = 0
    for start, end in spans:
        assert start == pos, f"gap or overlap at {pos}: next span starts at {start}"
        pos = end
    assert pos == a.size
    free = sorted(a._start_len.items())
    for (s1, n1), (s2, _) in zip(free, free[1:]):
        assert s1 + n1 < s2, "two free extents touch: they should have merged"
    assert a.free_bytes == sum(a._start_len.values())
    assert a._lengths == sorted(set(a._start_len.values()))


def test_fresh_arena_is_one_free_extent():
    a = ExtentAllocator(10_000)
    assert a.size == 10_000 - 10_000 % ALIGN
    assert a.free_bytes == a.size and a.largest_free == a.size and a.high_water() == 0


def test_allocations_are_aligned_and_packed_low():
    a = ExtentAllocator(1 << 20)
    offsets = [a.alloc(n) for n in (1, 100, 64, 65)]
    assert offsets == [0, 64, 192, 256]
    assert a.high_water() == 256 + 128


def test_best_fit_prefers_the_smallest_hole_then_the_lowest():
    a = ExtentAllocator(1 << 20)
    blocks = [a.alloc(4096) for _ in range(6)]
    a.free(blocks[1], 4096)  # a hole of one block
    a.free(blocks[3], 4096)
    a.free(blocks[4], 4096)  # merges with 3: a hole of two
    assert a.alloc(4096) == blocks[1]  # the one-block hole, not the tail
    assert a.alloc(8192) == blocks[3]
    assert a.alloc(4096) == blocks[5] + 4096  # no hole left: the tail


def test_free_merges_both_neighbours():
    a = ExtentAllocator(1 << 16)
    x, y, z = a.alloc(640), a.alloc(640), a.alloc(640)
    a.free(x, 640)
    a.free(z, 640)
    a.free(y, 640)
    assert list(a._start_len.items()) == [(0, a.size)]


def test_no_room_is_none():
    a = ExtentAllocator(4096)
    assert a.alloc(4096) == 0
    assert a.alloc(1) is None
    assert a.largest_free == 0


def test_double_free_is_refused():
    a = ExtentAllocator(1 << 16)
    a.alloc(64)
    a.free(0, 64)
    with pytest.raises(ValueError):
        a.free(0, 64)
    with pytest.raises(ValueError):
        a.free(-64, 64)


def test_truncate_drops_the_tail_for_good():
    a = ExtentAllocator(1 << 16)
    x = a.alloc(4096)
    y = a.alloc(4096)
    a.truncate(8192)
    assert a.size == 8192 and a.alloc(64) is None
    a.free(y, 4096)
    assert a.alloc(4096) == y  # below the truncation: reusable
    a.free(x, 4096)
    a.free(y, 4096)
    assert list(a._start_len.items()) == [(0, 8192)]


def test_truncate_below_an_extent_still_held_drops_the_free_extents_under_it_too():
    """After a clear gives back the memory under a put being copied, the
    store may have to truncate below that put: no free byte past the cut
    may be handed out, not only the free tail's."""
    a = ExtentAllocator(1 << 16)
    x = a.alloc(4096)
    hole = a.alloc(8192)
    held = a.alloc(4096)  # a put being copied, still held above the cut
    a.free(hole, 8192)
    a.truncate(8192)
    assert a.size == 8192
    assert a.free_extents() == [(4096, 8192)]
    assert a.alloc(4096) == 4096 and a.alloc(64) is None
    a.free(held, 4096)  # past the cut: gone for good
    assert a.alloc(64) is None
    assert x == 0


def test_free_extents_below_the_high_water():
    a = ExtentAllocator(1 << 16)
    first, second, third = a.alloc(4096), a.alloc(4096), a.alloc(4096)
    a.free(first, 4096)
    a.free(second, 4096)
    assert a.free_extents(below=a.high_water()) == [(0, 8192)]
    assert a.free_extents() == [(0, 8192), (third + 4096, 1 << 16)]


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_the_arena_tiled(seed):
    rng = random.Random(seed)
    a = ExtentAllocator(1 << 20)
    allocated: dict[int, int] = {}
    for _ in range(3000):
        if allocated and (rng.random() < 0.45 or a.largest_free < 1 << 14):
            start = rng.choice(list(allocated))
            a.free(start, allocated.pop(start))
        else:
            n = rng.choice([64, 1000, 4096, 4096, 12_288, rng.randint(1, 1 << 14)])
            start = a.alloc(n)
            if start is None:
                assert a.largest_free < aligned(n)
                continue
            assert start % ALIGN == 0
            allocated[start] = n
        check_invariants(a, allocated)
    for start, n in list(allocated.items()):
        a.free(start, n)
    assert a.free_bytes == a.size and len(a._start_len) == 1
