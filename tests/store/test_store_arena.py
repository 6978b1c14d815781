"""The arena file: memory committed one step ahead of the puts, in the
background, and given back without a commit ahead taking it again; a
client's mapping faulted in with the GIL let go."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import uuid

import pytest

from sglang_simm.local_store import _arena
from sglang_simm.local_store._segments import ArenaFile, ArenaMap

STEP = 4 << 20


@pytest.fixture
def arena(host_store_dir):
    path = os.path.join(host_store_dir, f"arena-{uuid.uuid4().hex[:8]}")
    a = ArenaFile(path, 16 * STEP)  # steps of STEP
    assert a.step == STEP
    yield a
    a.wait_ahead(10)
    a.close()


def held(a: ArenaFile) -> int:
    """Bytes of the file backed by memory."""
    return os.stat(a.path).st_blocks * 512


def test_a_commit_is_followed_by_the_next_step_in_the_background(arena):
    assert arena.commit(STEP // 2) == STEP  # one step, at once
    arena.wait_ahead(10)
    # the put that next crosses into step 2 finds it committed already
    assert arena.committed == 2 * STEP
    assert held(arena) >= 2 * STEP
    assert arena.commit(STEP + 1) == 2 * STEP  # nothing to wait for
    arena.wait_ahead(10)
    assert arena.committed == 3 * STEP  # and one more step ahead again
    assert arena.commit(16 * STEP) == 16 * STEP  # up to the end, never past it
    arena.wait_ahead(10)
    assert arena.committed == 16 * STEP


def test_memory_given_back_is_not_taken_again_by_a_commit_ahead(arena):
    arena.commit(3 * STEP)
    # the commit ahead may be in flight now: given back, nothing stays committed
    assert arena.release_after(0) == 0
    arena.wait_ahead(10)
    assert arena.committed == 0
    assert held(arena) < STEP


def test_a_commit_ahead_the_filesystem_refuses_is_quiet_and_the_put_that_needs_it_says_so(arena, monkeypatch, caplog):
    real = os.posix_fallocate

    def full_past_one_step(fd, offset, length):
        if offset + length > STEP:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_past_one_step)
    with caplog.at_level(logging.WARNING, logger="sglang_simm.local_store"):
        assert arena.commit(STEP) == STEP
        arena.wait_ahead(10)
        assert arena.committed == STEP and not arena._ahead_ok
        assert not caplog.records  # a refused commit ahead is no error yet
        assert arena.commit(STEP + 4096) == STEP  # the put that needs it: short, and said
    assert any("shared memory is full" in r.getMessage() for r in caplog.records)
    assert arena.commit_error and "committing" in arena.commit_error
    arena.wait_ahead(10)
    arena.release_after(0)  # memory given back: commits ahead are tried again
    assert arena._ahead_ok


def test_close_waits_for_a_commit_ahead_in_flight(host_store_dir, monkeypatch):
    path = os.path.join(host_store_dir, f"arena-{uuid.uuid4().hex[:8]}")
    a = ArenaFile(path, 16 * STEP)
    started, go = threading.Event(), threading.Event()
    real = os.posix_fallocate
    seen: list[int] = []

    def slow_ahead(fd, offset, length):
        if offset >= STEP:  # the commit ahead
            started.set()
            go.wait(10)
        seen.append(fd)
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow_ahead)
    a.commit(1)
    assert started.wait(10)
    closer = threading.Thread(target=a.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waits for the fallocate, which still has its fd
    go.set()
    closer.join(10)
    assert not closer.is_alive() and a._fd == -1
    a.wait_ahead(10)
    assert not os.path.exists(path)
    assert len(seen) == 2  # the step asked for, and the one ahead: none after close


def _rss_of_mapping(address: int) -> int:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_a_client_faults_its_mapping_in_through_a_call_that_lets_the_gil_go(arena):
    arena.commit(8 << 20)
    m = ArenaMap(arena.path, arena.size)
    try:
        before = _rss_of_mapping(m.base)
        m.populate(6 << 20)
        after = _rss_of_mapping(m.base)
        assert after - before >= 6 << 20, f"{after - before} bytes faulted in, not 6 MiB"
        assert m._populated == 6 << 20
        # ctypes.CDLL, not PyDLL: a server's scheduler thread runs meanwhile
        assert _arena._madvise_released is not None
        assert not _arena._madvise_released._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    finally:
        m.retire()
    m.populate(12 << 20)  # unmapped: nothing is touched
    assert m._populated == 6 << 20


def test_memory_a_client_faults_in_past_the_committed_arena_is_given_back(arena):
    """A client's thread faulting in behind its puts may run on a target set
    before a clear gave that memory back: touching a page of the shared file
    backs it again, past anything the store committed."""
    arena.commit(2 * STEP)
    arena.wait_ahead(10)
    m = ArenaMap(arena.path, arena.size)
    try:
        ctypes.memset(m.base, 0x5A, STEP)  # an object's bytes, below what stays committed
        m.populate(8 * STEP)  # the client's target: everything committed before the clear
        # the clear: nothing lies past the first step (what this process
        # committed, and what clients faulted in past it)
        assert arena.release_after(STEP, upto=arena.size) == STEP
        assert held(arena) < 2 * STEP
        assert arena.release_stale() == 0  # nothing past it yet
        m._populated = STEP
        m.populate(8 * STEP)  # the lagging thread, after the clear
        assert held(arena) >= 7 * STEP
        assert arena.release_stale() >= 6 * STEP
        assert held(arena) <= STEP + (64 << 10)
        assert ctypes.string_at(m.base, STEP) == b"\x5a" * STEP  # what the store handed out is untouched
    finally:
        m.retire()


@pytest.mark.parametrize("punch", ["works", "fails"])
def test_a_taken_over_file_keeps_the_objects_below_its_high_water(host_store_dir, monkeypatch, punch):
    """A store taking over a file never committed the memory its objects
    lie in: giving back what lies past their high water must leave them,
    and so must a later trim where that first punch failed."""
    path = os.path.join(host_store_dir, f"arena-{uuid.uuid4().hex[:8]}")
    first = ArenaFile(path, 16 * STEP)
    first.commit(4 * STEP)
    first.wait_ahead(10)
    m = ArenaMap(path, first.size)
    try:
        ctypes.memset(m.base + STEP, 0xA5, 2 * STEP)
        first._close(unlink=False)  # the store died; its file stays
        taken = ArenaFile(path, 16 * STEP, reuse=True)
        try:
            assert taken.reused and taken.committed == 0
            real_punch = _arena._punch_hole
            if punch == "fails":
                monkeypatch.setattr(_arena, "_punch_hole", lambda *a: False)
            taken.release_after(3 * STEP, upto=taken.size)  # the objects' high water
            monkeypatch.setattr(_arena, "_punch_hole", real_punch)
            assert taken.release_stale() == 0
            assert held(taken) >= 3 * STEP
            assert ctypes.string_at(m.base + STEP, 2 * STEP) == b"\xa5" * (2 * STEP)
        finally:
            taken.close()
    finally:
        m.retire()


def test_memory_backed_again_in_free_extents_past_the_committed_prefix_is_given_back(arena):
    """Free memory between the committed prefix and a put being copied
    above it, backed again by a lagging fault-in, goes back; nothing below
    the prefix or outside the extents given (objects, the put) is touched."""
    arena.commit(4 * STEP)
    arena.wait_ahead(10)
    m = ArenaMap(arena.path, arena.size)
    try:
        ctypes.memset(m.base, 0x11, STEP)  # an object below the free extent
        ctypes.memset(m.base + 3 * STEP, 0x22, STEP)  # a put being copied above it
        assert arena.release_holes([(STEP, 3 * STEP)]) == STEP  # the clear
        m._populated = 0
        m.populate(3 * STEP)  # the lagging thread
        assert held(arena) >= 4 * STEP
        # an extent below the prefix is never punched, whatever the caller says
        assert arena.release_refaulted([(0, STEP)]) == 0
        assert arena.release_refaulted([(0, STEP), (STEP, 3 * STEP)]) >= 2 * STEP - (64 << 10)
        assert ctypes.string_at(m.base, STEP) == b"\x11" * STEP
        assert ctypes.string_at(m.base + 3 * STEP, STEP) == b"\x22" * STEP
        assert arena.release_refaulted([(STEP, 3 * STEP)]) == 0  # nothing left there
    finally:
        m.retire()
