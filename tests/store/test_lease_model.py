"""A model of the lease protocol, checked by Hypothesis against the real
``StoreIndex``: clients that grant, copy, stall, die, lose their
connection and fence, and store processes that crash and are taken over
from the lease table and index they leave behind.

The invariant, checked after every step (docs/local-store.md, the rule at
the top): **no byte granted to a live holder is granted to another.** A
holder is a copy in flight: a put's from before its PUT is sent (the
client counts it then) to its end, a get's likewise. Puts' bytes may
overlap no other copy's; gets may share bytes with gets.

What the model takes from the code is the store's side entire (``StoreIndex``:
grants, ``disconnect``, ``fence``, ``reap``, ``lease_records`` and
``restore`` at a takeover) and the client's rules (``_host``): a copy is
in flight from before its request; a lost connection is fenced only once
none of its copies is in flight; a fence names the store process (epoch)
and the connection. ``test_the_model_finds_*`` take one fix out and
expect Hypothesis to find the wrong bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_simm.local_store._allocator import aligned
from sglang_simm.local_store._segments import LEASE_WORDS
from sglang_simm.local_store._index import StoreIndex, lease_records
from sglang_simm.local_store._limits import StoreLimits
from sglang_simm.local_store._table import Recovered
from sglang_simm.errors import OK

MAX_LEASES = 24
LIMITS = StoreLimits(max_leases=MAX_LEASES, max_leases_per_connection=4, max_objects=64)
DATA_START = 8 * LEASE_WORDS * (MAX_LEASES + 1)
ARENA = DATA_START + 16 * 1024
CAPACITY = 12 * 1024
SIZES = st.sampled_from([64, 500, 1000, 2048, 4000])
KEYS = [f"k{i}".encode() for i in range(10)]


class MemTable:
    """The crash-consistent index table, in memory: it outlives a store
    process as the file does."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[bytes, int, int, int]] = {}

    def commit(self, slots, keys, offsets, sizes, first_seq) -> None:
        for i, (slot, key, off, size) in enumerate(zip(slots, keys, offsets, sizes)):
            self.rows[slot] = (key, off, size, first_seq + i)

    def free(self, slots) -> None:
        for slot in slots:
            self.rows.pop(slot, None)

    def clear(self) -> None:
        self.rows.clear()

    def recover(self) -> Recovered:
        items = sorted(self.rows.items(), key=lambda kv: kv[1][3])
        return Recovered(keys=[r[0] for _, r in items], offsets=[r[1] for _, r in items],
                         sizes=[r[2] for _, r in items], seqs=[r[3] for _, r in items],
                         slots=[s for s, _ in items])


@dataclass
class Copy:
    """A copy a client may still be doing: it may touch ``extents``."""

    put: bool
    conn: tuple[int, int]  # (epoch, connection) it was granted on
    lease: int = 0
    extents: list[tuple[int, int]] = field(default_factory=list)
    started: bool = False  # its reply was read (the copy proper began)


@dataclass
class Client:
    pid: int
    start: int = 1
    alive: bool = True
    conn: tuple[int, int] | None = None  # (epoch, connection id)
    copies: list[Copy] = field(default_factory=list)
    lost: list[tuple[int, int]] = field(default_factory=list)  # connections to fence


class Mutations:
    """Fixes the model can take out, to show it finds what they prevent."""

    disconnect_frees = False  # finding 1: a closed connection's leases end at once
    no_takeover_holds = False  # finding 2: a takeover keeps no live holder's grants
    count_after_reply = False  # finding 5: a copy counted in flight only once its reply is read


class LeaseModel(RuleBasedStateMachine):
    mutations = Mutations()
    runs = 0  # examples (machines) run, for the report

    def __init__(self) -> None:
        super().__init__()
        type(self).runs += 1
        self.table = MemTable()
        self.words = [0] * (LEASE_WORDS * (MAX_LEASES + 1))
        self.epoch = 1
        self.index = self._index()
        self.next_conn = 1
        self.clients = [Client(pid=100 + i) for i in range(3)]
        self.violation = ""

    def _index(self) -> StoreIndex:
        index = StoreIndex(capacity=CAPACITY, arena_bytes=ARENA, limits=LIMITS, data_start=DATA_START,
                           lease_words=self.words, table=self.table, epoch=self.epoch)
        if self.mutations.disconnect_frees:
            index.disconnect = lambda owner: (index.drop_owner(owner), 0)[1]
        return index

    def _alive(self, pid: int, start: int) -> bool:
        return any(c.pid == pid and c.start == start and c.alive for c in self.clients)

    def _owner(self, conn: tuple[int, int]):
        """The index's owner key for a connection: its id in its own store
        process, (epoch, id) for one of a dead store process."""
        return conn[1] if conn[0] == self.epoch else conn

    # -- clients ------------------------------------------------------------------

    @rule(c=st.integers(0, 2))
    def connect(self, c: int) -> None:
        client = self.clients[c]
        if not client.alive or client.conn is not None:
            return
        client.conn = (self.epoch, self.next_conn)
        self.next_conn += 1
        self.index.connect(client.conn[1], client.pid, client.start)
        self._fence_lost(client)

    def _fence_lost(self, client: Client) -> None:
        """The client's rule: a lost connection is fenced once none of its
        copies is in flight (as the client counts them)."""
        for lost in list(client.lost):
            counted = [cp for cp in client.copies
                       if cp.conn == lost and (cp.started or not self.mutations.count_after_reply)]
            if not counted:
                self.index.fence(self._owner(lost), client.pid, own=False)
                client.lost.remove(lost)

    @rule(c=st.integers(0, 2), n=st.integers(1, 3), size=SIZES)
    def grant_put(self, c: int, n: int, size: int) -> None:
        client = self.clients[c]
        if not client.alive or client.conn is None:
            return
        keys = [KEYS[(len(client.copies) * 3 + i + c) % len(KEYS)] for i in range(n)]
        lease, codes, offsets = self.index.begin_put(client.conn[1], keys, [size] * n, True)
        if lease:
            ext = [(o, o + aligned(size)) for o, code in zip(offsets, codes) if code == OK]
            client.copies.append(Copy(True, client.conn, lease, ext))

    @rule(c=st.integers(0, 2), k=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def grant_get(self, c: int, k: list[bytes]) -> None:
        client = self.clients[c]
        if not client.alive or client.conn is None:
            return
        lease, results, offsets = self.index.begin_get(client.conn[1], k, [1 << 20] * len(k))
        if lease:
            ext = [(o, o + aligned(max(r, 1))) for o, r in zip(offsets, results) if r >= 0]
            client.copies.append(Copy(False, client.conn, lease, ext))

    @rule(c=st.integers(0, 2), i=st.integers(0, 7))
    def start_copy(self, c: int, i: int) -> None:
        """The reply was read: the copy proper begins (it may stall here)."""
        copies = self.clients[c].copies
        if copies:
            copies[i % len(copies)].started = True

    @rule(c=st.integers(0, 2), i=st.integers(0, 7))
    def finish_copy(self, c: int, i: int) -> None:
        """A copy ends: COMMIT or RELEASE on its connection if that is still
        open, else the connection waits for its fence."""
        client = self.clients[c]
        if not client.alive or not client.copies:
            return
        cp = client.copies.pop(i % len(client.copies))
        if client.conn == cp.conn:
            if cp.put:
                self.index.commit_put(cp.lease, owner=cp.conn[1])
            else:
                self.index.release(cp.lease, owner=cp.conn[1])
        if client.conn is not None:
            self._fence_lost(client)

    @rule(c=st.integers(0, 2))
    def lose_connection(self, c: int) -> None:
        """The store drops it (bad frame, input budget), or the client's
        disconnect or a timeout: copies under it may go on."""
        client = self.clients[c]
        if client.conn is None:
            return
        lost, client.conn = client.conn, None
        self.index.disconnect(lost[1])
        client.lost.append(lost)

    @rule(c=st.integers(0, 2))
    def die(self, c: int) -> None:
        """kill -9: its copies stop; its socket closes; its pid may come
        back as another process (start time differs)."""
        client = self.clients[c]
        if client.conn is not None and client.conn[0] == self.epoch:
            self.index.disconnect(client.conn[1])
        self.clients[c] = Client(pid=client.pid, start=client.start + 1)

    @rule()
    def housekeeping(self) -> None:
        self.index.reap(self._alive)

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: bytes) -> None:
        self.index.delete(k)

    @rule()
    def clear(self) -> None:
        self.index.clear()

    # -- the store process -------------------------------------------------------------

    @rule()
    def crash_store(self) -> None:
        """kill -9 of the store; the next store process takes over from the
        lease table and the index table it left."""
        old_epoch, records = lease_records(self.words, MAX_LEASES + 1)
        holds = [r for r in records if self._alive(r[2], r[3])]
        if self.mutations.no_takeover_holds:
            holds = []
        kept = {r[0] for r in holds}
        for slot, *_ in records:
            if slot not in kept:
                self.words[slot * LEASE_WORDS] = 0
        self.epoch = old_epoch + 1
        self.index = self._index()
        self.index.restore(self.table.recover(), holds)
        for client in self.clients:
            if client.conn is not None:
                client.lost.append(client.conn)
                client.conn = None

    # -- the rule -----------------------------------------------------------------------

    @invariant()
    def no_byte_granted_twice(self) -> None:
        held = [(c.pid, j, cp.put, a, b) for c in self.clients if c.alive
                for j, cp in enumerate(c.copies) for a, b in cp.extents]
        held.sort(key=lambda h: h[3])
        for i, (pid, j, put, a, b) in enumerate(held):
            for pid2, j2, put2, a2, b2 in held[i + 1:]:
                if a2 >= b:
                    break
                if (pid, j) != (pid2, j2) and (put or put2):
                    raise AssertionError(f"bytes [{max(a, a2)}, {min(b, b2)}) granted to client {pid} copy {j} "
                                         f"({'put' if put else 'get'}) and client {pid2} copy {j2} "
                                         f"({'put' if put2 else 'get'}) at once")

    @invariant()
    def accounting_holds(self) -> None:
        index = self.index
        assert index.used == sum(o.size for o in index.objects.values())


SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def test_no_byte_granted_to_a_live_holder_is_granted_to_another():
    run = LeaseModel.TestCase
    run.settings = SETTINGS
    run().runTest()
    print(f"{LeaseModel.runs} examples of up to {SETTINGS.stateful_step_count} steps")


@pytest.mark.parametrize("mutation", ["disconnect_frees", "no_takeover_holds", "count_after_reply"])
def test_the_model_finds_the_wrong_bytes_a_missing_fix_lets_through(mutation):
    class Mutated(Mutations):
        pass

    setattr(Mutated, mutation, True)

    class MutatedModel(LeaseModel):
        mutations = Mutated()
        runs = 0

    run = MutatedModel.TestCase
    run.settings = settings(SETTINGS, max_examples=5000, phases=[Phase.generate])  # found, not shrunk
    with pytest.raises(AssertionError, match="granted to client"):
        run().runTest()
    print(f"{mutation}: found after {MutatedModel.runs} examples")
