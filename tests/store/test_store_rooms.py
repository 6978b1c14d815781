"""Rooms: put extents a connection holds, so that a backup waits for no reply.

The index's bookkeeping (no processes), the client's (``_room``, pure), the
store process refusing what a hostile peer sends, and a real client's
backups through a room: published before the put returns, nothing left
behind when it goes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import uuid

import pytest

from raw_peer import Peer, StoreProc, wait_for
from test_host_store import kill, start_child, wait_ready
from test_store_index import A, B, ks

from sglang_simm.embedded import _host
from sglang_simm.embedded._host import HostServer
from sglang_simm.embedded._index import LeaseError, StoreIndex
from sglang_simm.embedded._protocol import Op
from sglang_simm.embedded._room import MAX_ROOMS, Ask, Rooms
from sglang_simm.errors import DS_KEY_NOT_FOUND, INVALID_ARGUMENT, OK, SEND_RPC_FAILED

# -- the index ----------------------------------------------------------------


@pytest.fixture
def index():
    return StoreIndex(capacity=100_000, arena_bytes=1 << 20)


def test_a_room_is_reserved_room_that_nobody_sees_until_its_extents_are_published(index):
    lease, offsets = index.reserve_room(A, 1000, 8)
    assert lease and len(offsets) == len(set(offsets)) == 8
    assert index.reserved == 8000 and index.used == 0 and index.snapshot()["rooms_open"] == 1
    assert index.commit_room(lease, A, ks("a", "b"), offsets[:2]) == [OK, OK]
    assert index.lookup(ks("a", "b")) == [OK, OK]
    assert (index.reserved, index.used) == (6000, 2000)
    lease_g, sizes, got = index.begin_get(B, ks("b"), [1000])
    assert sizes == [1000] and got == [offsets[1]]  # the key names the extent it was published in
    index.release(lease_g, owner=B)
    # the rest of the room is still this connection's; used up, the room ends
    assert index.commit_room(lease, A, ks(*"cdefgh"), offsets[2:]) == [OK] * 6
    assert index.snapshot()["rooms_open"] == 0 and index.open_leases() == 0
    assert index.reserved == 0 and index.used == 8000


def test_a_commit_naming_extents_not_in_its_room_publishes_only_its_own(index):
    lease, offsets = index.reserve_room(A, 1000, 4)
    other, other_offsets = index.reserve_room(B, 1000, 4)
    codes = index.commit_room(lease, A, ks("mine", "theirs", "twice", "twice-again", "nowhere"),
                              [offsets[0], other_offsets[0], offsets[1], offsets[1], 12345])
    assert codes == [OK, INVALID_ARGUMENT, OK, INVALID_ARGUMENT, INVALID_ARGUMENT]
    assert index.lookup(ks("mine", "theirs", "twice", "twice-again", "nowhere")) == [OK, DS_KEY_NOT_FOUND, OK,
                                                                                     DS_KEY_NOT_FOUND, DS_KEY_NOT_FOUND]
    assert index.stats["refused_room"] == 3
    # B's room is untouched: all four extents still publish
    assert index.commit_room(other, B, ks("b0", "b1", "b2", "b3"), other_offsets) == [OK] * 4


def test_a_bad_key_in_a_room_commit_is_refused_and_its_extent_given_back(index):
    lease, offsets = index.reserve_room(A, 1000, 2)
    free_before = index.alloc.free_bytes
    assert index.commit_room(lease, A, [b"x" * 300, b"ok"], offsets) == [INVALID_ARGUMENT, OK]
    assert index.alloc.free_bytes == free_before + 1024  # one aligned extent back
    assert index.reserved == 0 and index.stats["refused_key"] == 1 and len(index.objects) == 1


def test_a_room_is_its_connections_alone_and_not_a_put_lease(index):
    lease, offsets = index.reserve_room(A, 1000, 2)
    with pytest.raises(LeaseError) as exc:
        index.commit_room(lease, B, ks("k"), offsets[:1])
    assert exc.value.code == INVALID_ARGUMENT and "another connection" in str(exc.value)
    with pytest.raises(LeaseError) as exc:
        index.commit_put(lease, owner=A)
    assert "COMMIT_ROOM" in str(exc.value)
    with pytest.raises(LeaseError) as exc:
        index.commit_room(lease + 99, A, ks("k"), offsets[:1])
    assert exc.value.code == SEND_RPC_FAILED
    assert index.commit_room(lease, A, ks("k"), offsets[:1]) == [OK]  # still open after all that


def test_a_room_counts_against_the_capacity_and_goes_with_its_connection():
    index = StoreIndex(capacity=800_000, arena_bytes=1 << 21)
    lease, offsets = index.reserve_room(A, 100_000, 1)
    assert index.reserved == 100_000
    codes = [index.begin_put(B, [f"p{i}".encode()], [100_000], True)[1][0] for i in range(8)]
    assert codes[:7] == [OK] * 7 and codes[7] != OK  # 100k held + 700k: the capacity is full
    assert index.drop_owner(A) == 1
    assert index.reserved == 700_000 and index.snapshot()["room_extents"] == 0


def test_all_rooms_together_hold_at_most_an_eighth_of_the_capacity(index):
    """However many connections ask, rooms never evict the cache for room
    nobody writes: past the share a room is smaller, then none."""
    granted = [index.reserve_room(owner, 1000, 8) for owner in range(1, 6)]
    assert [len(offsets) for _, offsets in granted] == [8, 4, 0, 0, 0]  # 12,500 bytes of 100,000
    assert granted[2][0] == 0 and index.room_bytes_held() == 12_000
    index.commit_room(granted[0][0], 1, ks(*"abcdefgh"), granted[0][1])  # published: no longer held
    assert len(index.reserve_room(9, 1000, 8)[1]) == 8


def test_an_expired_room_is_quarantined_until_its_connection_closes(index):
    now = [0.0]
    index = StoreIndex(capacity=100_000, arena_bytes=1 << 20, clock=lambda: now[0])
    lease, offsets = index.reserve_room(A, 1000, 4)
    now[0] = 10.0
    assert index.commit_room(lease, A, ks("a"), offsets[:1]) == [OK]  # renews the lease
    now[0] = 35.0
    assert index.expire(30.0) == 0  # 25 s since the commit
    now[0] = 41.0
    assert index.expire(30.0) == 1
    # its writer may still be copying: the extents are not handed out again
    assert index.quarantined_bytes == 3000 and index.reserved == 0
    lease2, offsets2 = index.reserve_room(B, 1000, 4)
    assert not set(offsets2) & set(offsets[1:])
    with pytest.raises(LeaseError):
        index.commit_room(lease, A, ks("late"), offsets[1:2])
    index.drop_owner(A)
    assert index.quarantined_bytes == 0 and index.lookup(ks("a")) == [OK]


def test_a_capacity_change_ends_every_room_into_quarantine(index):
    lease, offsets = index.reserve_room(A, 1000, 8)
    index.set_capacity(5000)
    assert index.reserved == 0 and index.quarantined_bytes == 8000 and index.snapshot()["rooms_open"] == 0
    with pytest.raises(LeaseError):
        index.commit_room(lease, A, ks("k"), offsets[:1])
    index.drop_owner(A)
    assert index.quarantined_bytes == 0


# -- the client's bookkeeping -------------------------------------------------------


def rooms(now):
    return Rooms(room_bytes=1 << 20, room_entries=64, lease_timeout_s=30.0, clock=lambda: now[0])


def test_rooms_are_asked_for_when_half_used_and_used_only_while_fresh():
    now = [100.0]
    r = rooms(now)
    assert r.count_for(1 << 21) == 0 and r.count_for(1 << 14) == 64  # too big for a room; capped entries
    ask, drop = r.ask(1 << 14)
    assert ask == Ask(1 << 14, 64, 100.0) and drop == []
    assert r.ask(1 << 14) == (None, [])  # one in flight
    r.granted(ask, 7, list(range(64 * (1 << 14), 0, -(1 << 14))))
    assert r.take(1 << 14, 17) is None  # over a quarter of a room: a batch that asks for its own
    room, offsets = r.take(1 << 14, 16)
    assert offsets == sorted(offsets) and room.lease == 7 and room.copying == 1
    assert r.renewed(room, 100.0) == [] and room.copying == 0
    assert r.take(1 << 15, 1) is None  # another size
    r.renewed(r.take(1 << 14, 16)[0], 100.0)
    assert r.ask(1 << 14) == (None, [])  # 32 of 64 left
    r.renewed(r.take(1 << 14, 4)[0], 100.0)
    assert r.ask(1 << 14)[0] is not None  # 28 left: the next is asked for
    now[0] = 100.0 + 15.0
    assert r.take(1 << 14, 1) is None  # past half the lease time limit since its last commit
    assert r.stale() == [room] and r.rooms == []


def test_a_commit_renews_a_room_and_an_empty_room_is_gone():
    now = [0.0]
    r = rooms(now)
    ask, _ = r.ask(4096)
    r.granted(ask, 1, [0, 4096])
    room, _ = r.take(4096, 1)
    now[0] = 14.0
    r.renewed(room, 14.0)
    now[0] = 28.0
    room, _ = r.take(4096, 1)  # fresh until 29
    assert r.renewed(room, 28.0) == []  # used up: the store ends it, nothing to give back
    assert r.rooms == []


def test_a_room_is_given_back_only_once_no_copy_into_it_is_in_flight():
    """Giving a room back frees every extent it has not published, those
    another thread is copying into included: a room that goes stale, gives
    way or fails while a copy is in flight waits for that copy."""
    now = [0.0]
    r = rooms(now)
    ask, _ = r.ask(4096)
    r.granted(ask, 1, [i * 4096 for i in range(1, 9)])
    room, _ = r.take(4096, 2)  # thread A copies
    now[0] = 15.0
    assert r.stale() == [] and r.rooms == [] and room.retired  # no new backups into it, not given back yet
    assert r.renewed(room, 15.0) == [room]  # A's commit is sent: now it goes
    ask, _ = r.ask(4096)
    r.granted(ask, 2, [i * 4096 for i in range(10, 18)])
    room2, _ = r.take(4096, 1)
    other, _ = r.take(4096, 1)  # two copies in flight
    assert other is room2 and r.failed(room2) == []  # one fails: the room goes, after the other
    assert r.take(4096, 1) is None
    assert r.renewed(room2, 15.5) == [room2]


def test_a_room_of_another_size_gives_way_and_a_refusal_waits_before_asking_again():
    now = [0.0]
    r = rooms(now)
    for size in (64, 4096):
        ask, _ = r.ask(size)
        r.granted(ask, size, [i * size for i in range(1, 3)])
    assert len(r.rooms) == MAX_ROOMS
    ask, drop = r.ask(8192)  # a third size: the other rooms' emptiest goes back
    assert ask is not None and len(drop) == 1 and len(r.rooms) == MAX_ROOMS - 1
    r.refused()
    assert r.ask(8192) == (None, [])
    now[0] = 2.0
    assert r.ask(8192)[0] is not None
    r.granted(r.asking, 0, [])  # the store had no room: later again
    assert r.ask(8192) == (None, [])


# -- the store process and raw peers ------------------------------------------------


@pytest.fixture
def store(host_store_dir):
    s = StoreProc(host_store_dir, f"room-{uuid.uuid4().hex[:8]}", capacity=64 << 20)
    yield s
    s.stop()


def test_the_store_refuses_rooms_past_its_limits_with_the_reason(store):
    with Peer(store.paths) as p:
        assert p.info["room_bytes"] == 4 << 20 and p.info["room_entries"] == 256  # a sixteenth of 64 MiB
        for size, count, why in ((1 << 20, 5, "4194304 bytes"), (1024, 257, "256 entries"), (0, 4, "room_bytes"),
                                 (-1, 4, "room_bytes"), (1024, 0, "room_bytes")):
            op, err = p.reserve(size, count)
            assert op == Op.ERROR and err["code"] == INVALID_ARGUMENT and why in err["error"], (size, count, err)
        assert p.reserve(1 << 16, 4)[0] == Op.RESERVE and p.reserve(1 << 16, 4)[0] == Op.RESERVE
        op, err = p.reserve(1 << 16, 4)
        assert op == Op.ERROR and "2 rooms already" in err["error"]
        assert p.lookup(["x"]) == [DS_KEY_NOT_FOUND]  # the connection goes on
    assert store.status()["refused_room"] == 6


def test_a_peer_cannot_publish_into_another_connections_room_or_outside_its_own(store):
    with Peer(store.paths) as a, Peer(store.paths) as b:
        _, (lease, offsets) = a.reserve(4096, 4)
        op, err = b.commit_room(lease, ["stolen"], offsets[:1])
        assert op == Op.ERROR and err["code"] == INVALID_ARGUMENT
        op, codes = a.commit_room(lease, ["k0", "k1"], [offsets[0], offsets[0] + 64])
        assert op == Op.COMMIT_ROOM and codes == [OK, INVALID_ARGUMENT]
        assert b.lookup(["stolen", "k0", "k1"]) == [DS_KEY_NOT_FOUND, OK, DS_KEY_NOT_FOUND]
        # keys and offsets of different lengths: a malformed frame, the connection is dropped
        a.send(_frame_commit_room(lease, ["k2", "k3"], offsets[1:2]))
        assert a.closed_by_store()
    wait_for(lambda: store.status()["rooms_open"] == 0, what="the room to go with its connection")
    status = store.status()
    assert status["room_reserved_bytes"] == 0 and status["objects"] == 1


def _frame_commit_room(lease, keys, offsets):
    from sglang_simm.embedded._protocol import encode_keys, frame, pack_i64, pack_ints

    return frame(Op.COMMIT_ROOM, pack_i64(lease), encode_keys(keys), pack_ints(offsets))


# -- a real client ----------------------------------------------------------------


def client_of(store: StoreProc) -> HostServer:
    c = HostServer(store.paths.name, root=store.paths.root, capacity=1, spawn=False, timeout_s=10.0)
    c.open()
    return c


def test_a_backup_into_a_room_waits_for_no_reply_and_is_seen_at_once_elsewhere(store, monkeypatch):
    client = client_of(store)
    other = client_of(store)
    size = 64 << 10
    data = [ctypes.create_string_buffer(bytes([i + 1]) * size, size) for i in range(8)]
    assert client.put_from([("first", ctypes.addressof(data[0]), size)], True) == [OK]  # asks for a room
    client.settle()
    sent = []  # (op, a reply waited for) of the client's own connection
    real_exchange = _host._Connection.exchange

    def exchange(self, data, *, reply=True, timeout_s=None):
        if self is client._conn:
            sent.append((Op(data[4]), reply))
        return real_exchange(self, data, reply=reply, timeout_s=timeout_s)

    monkeypatch.setattr(_host._Connection, "exchange", exchange)
    for i in range(1, 8):
        keys = [(f"k{i}-{j}", ctypes.addressof(data[i]), size) for j in range(2)]
        assert client.put_from(keys, True) == [OK, OK]
        assert other.lookup([f"k{i}-0", f"k{i}-1"]) == [OK, OK]  # published before put_from returned
    monkeypatch.undo()
    assert sent and {op for op, _ in sent} <= {Op.COMMIT_ROOM, Op.RESERVE} and not any(r for _, r in sent), sent
    out = ctypes.create_string_buffer(size)
    for i in range(1, 8):
        assert other.get_into([(f"k{i}-1", ctypes.addressof(out), size)]) == [size]
        assert out.raw == bytes([i + 1]) * size
    client.settle()
    stats = client.stats()
    assert client.commit_failures == 0 and stats["puts"] == 15 and stats["rooms_open"] >= 1
    other.close()
    client.close()
    wait_for(lambda: store.status()["rooms_open"] == 0, what="the rooms to go with the connection")


def test_status_and_clear_from_another_connection_see_every_backup_sent_before_them(store):
    """A backup into a room is one frame the store has not answered when
    put_from returns: a status asked for after it counts it, and a clear
    asked for after it removes it (the store reads the other connections
    before an admin request as it does before a read)."""
    client = client_of(store)
    admin = client_of(store)
    size = 16 << 10
    data = ctypes.create_string_buffer(b"\x07" * size, size)
    assert client.put_from([("warm", ctypes.addressof(data), size)], True) == [OK]  # asks for a room
    client.settle()
    for i in range(100):
        before = admin.status()["objects"]
        assert client.put_from([(f"b{i}", ctypes.addressof(data), size)], True) == [OK]
        assert admin.status()["objects"] == before + 1
        if i % 10 == 9:
            assert client.put_from([(f"c{i}", ctypes.addressof(data), size)], True) == [OK]
            admin.clear()
            assert admin.lookup([f"c{i}"]) == [DS_KEY_NOT_FOUND]
    assert client.commit_failures == 0
    admin.close()
    client.close()


def test_a_client_killed_holding_a_room_leaves_nothing_behind(store):
    proc = start_child("room", root=store.paths.root, name=store.paths.name, size=64 << 10)
    wait_ready(proc)
    status = store.status()
    assert status["rooms_open"] == 1 and status["room_reserved_bytes"] > 0
    kill(proc)
    wait_for(lambda: store.status()["rooms_open"] == 0, what="the room to be dropped")
    status = store.status()
    assert status["room_reserved_bytes"] == 0 and status["reserved_bytes"] == 0 and status["open_leases"] == 0


def test_a_client_stopped_while_its_room_expires_publishes_nothing_into_reused_memory(store):
    """A client stopped (SIGSTOP) past the lease time limit: its room is
    quarantined, not handed out, and what it commits on waking is refused
    (a miss), never bytes over another's object."""
    proc = start_child("room", root=store.paths.root, name=store.paths.name, size=64 << 10, then="put")
    wait_ready(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with Peer(store.paths) as admin:
            assert admin.admin("expire_leases", older_than_s=0)["expired"] == 1
            assert admin.admin("status")["quarantined_bytes"] > 0
            other = client_of(store)
            big = ctypes.create_string_buffer(b"\x09" * (1 << 20), 1 << 20)
            assert other.put_from([(f"o{i}", ctypes.addressof(big), 1 << 20) for i in range(8)], True) == [OK] * 8
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert "commit_failures=1" in out, out
    buf = ctypes.create_string_buffer(1 << 20)
    for i in range(8):
        assert other.get_into([(f"o{i}", ctypes.addressof(buf), 1 << 20)]) == [1 << 20]
        assert buf.raw == b"\x09" * (1 << 20)
    assert other.lookup(["late"]) == [DS_KEY_NOT_FOUND]
    other.close()


def test_a_lowered_capacity_ends_the_rooms_and_their_clients_go_the_other_way(store):
    """Rooms sized for the old capacity could hold all of a smaller one: a
    capacity change ends them (quarantined until their connections close).
    The client's next backup into its room is refused (one miss, counted),
    the room is dropped, and the backups after it are stored."""
    client = client_of(store)
    other = client_of(store)
    size = 64 << 10
    buf = ctypes.create_string_buffer(b"\x03" * size, size)
    assert client.put_from([("warm", ctypes.addressof(buf), size)], True) == [OK]
    client.settle()
    assert store.status()["rooms_open"] == 1
    other.set_capacity(32 << 20)
    status = store.status()
    assert status["rooms_open"] == 0 and status["reserved_bytes"] == 0 and status["quarantined_bytes"] > 0
    assert client.put_from([("into-the-ended-room", ctypes.addressof(buf), size)], True) == [OK]
    client.settle()
    assert client.commit_failures == 1 and other.lookup(["into-the-ended-room"]) == [DS_KEY_NOT_FOUND]
    for i in range(3):
        assert client.put_from([(f"after-{i}", ctypes.addressof(buf), size)], True) == [OK]
    assert other.lookup([f"after-{i}" for i in range(3)]) == [OK] * 3
    client.settle()
    assert client.commit_failures == 1
    other.close()
    client.close()
    wait_for(lambda: store.status()["quarantined_bytes"] == 0, what="the quarantine to go with the connection")
