"""The extent allocator of a store process's own segment, against a model of
what is allocated."""

from __future__ import annotations

import random

import pytest

from sglang_simm.local_store._allocator import ALIGN, ExtentAllocator, aligned


def largest_free(a: ExtentAllocator) -> int:
    return max((end - start for start, end in a.free_extents()), default=0)


def check_invariants(a: ExtentAllocator, allocated: dict[int, int], start: int = 0) -> None:
    """Free extents and allocations tile ``[start, size)`` exactly, free extents never touch."""
    free = a.free_extents()
    spans = sorted([(s, s + aligned(n)) for s, n in allocated.items()] + free)
    pos = start
    for lo, hi in spans:
        assert lo == pos, f"gap or overlap at {pos}: next span starts at {lo}"
        pos = hi
    assert pos == a.size
    for (_, end1), (start2, _) in zip(free, free[1:]):
        assert end1 < start2, "two free extents touch: they should have merged"
    assert a.free_bytes == sum(hi - lo for lo, hi in free)


def test_a_fresh_segment_is_one_free_extent():
    a = ExtentAllocator(10_000)
    assert a.size == 10_000 - 10_000 % ALIGN
    assert a.free_bytes == a.size and a.free_extents() == [(0, a.size)]


def test_nothing_is_handed_out_below_the_data_start():
    """A segment's head (its header and client table) is never room for an object."""
    a = ExtentAllocator(1 << 16, 8192)
    assert a.free_extents() == [(8192, 1 << 16)] and a.free_bytes == (1 << 16) - 8192
    assert a.alloc(100) == 8192
    a.free(8192, 100)
    assert a.free_extents() == [(8192, 1 << 16)]


def test_a_segment_with_no_room_past_its_head_is_refused():
    with pytest.raises(ValueError, match="holds no object"):
        ExtentAllocator(4096, 4096)


def test_allocations_are_aligned_and_packed_low():
    a = ExtentAllocator(1 << 20)
    offsets = [a.alloc(n) for n in (1, 100, 64, 65)]
    assert offsets == [0, 64, 192, 256]
    assert a.free_extents() == [(256 + 128, a.size)]


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
    assert a.free_extents() == [(0, a.size)]


def test_no_room_is_none():
    a = ExtentAllocator(4096)
    assert a.alloc(4096) == 0
    assert a.alloc(1) is None
    assert a.free_extents() == [] and a.free_bytes == 0


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
    assert a.free_extents() == [(0, 8192)]


def test_truncate_below_an_extent_still_held_drops_the_free_extents_under_it_too():
    """When the host backs no more of the segment, the store truncates at
    what it backs, which may lie below a put still being copied (a clear gave
    back the memory under it): no free byte past the cut may be handed out,
    not only the free tail's."""
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


def test_free_extents_are_sorted_and_merged():
    """What a clear gives back: every free extent, neighbours as one."""
    a = ExtentAllocator(1 << 16)
    first, second, third = a.alloc(4096), a.alloc(4096), a.alloc(4096)
    a.free(first, 4096)
    a.free(second, 4096)
    assert a.free_extents() == [(0, 8192), (third + 4096, 1 << 16)]
    a.alloc(a.free_bytes - 8192)  # the whole tail
    assert a.free_extents() == [(0, 8192)]


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_the_segment_tiled(seed):
    rng = random.Random(seed)
    head = 4096 * (seed % 2)
    a = ExtentAllocator(1 << 20, head)
    allocated: dict[int, int] = {}
    for _ in range(3000):
        if allocated and (rng.random() < 0.45 or largest_free(a) < 1 << 14):
            start = rng.choice(list(allocated))
            a.free(start, allocated.pop(start))
        else:
            n = rng.choice([64, 1000, 4096, 4096, 12_288, rng.randint(1, 1 << 14)])
            start = a.alloc(n)
            if start is None:
                assert largest_free(a) < aligned(n)
                continue
            assert start % ALIGN == 0
            allocated[start] = n
        check_invariants(a, allocated, head)
    for start, n in list(allocated.items()):
        a.free(start, n)
    assert a.free_extents() == [(head, a.size)] and a.free_bytes == a.size - head
