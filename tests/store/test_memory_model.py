"""The memory rule, checked by Hypothesis over the store's own code.

Store processes start (fresh, or after a crash, a stop or an idle exit),
each with a segment of its own, on the real ``StoreIndex``, ``IndexTable``
and segment files; client processes ask for grants, copy, finish, lose their
connection, stop, are killed and fork. A client's copy is in flight from
before its request until it finishes, and counted in its row of the client
table as the real client counts it (``_maps.Busy``). After every step
(docs/local-store-design.md, the rule at the top):

* no byte a live client may still write is granted to another, read by
  another, or part of a published object;
* no byte a live client may still read is given back (punched) or written;
* no generation and no grant id repeats.

A copy is named by its segment's generation, as a client names what it
maps: a generation that repeats is two memories under one name. The
``test_the_model_finds_*`` tests break the rule on purpose (a store that
grants in an earlier segment, one that gives an earlier segment back
before it is quiet, generations counted from 1) and expect the check to
find wrong bytes.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_simm.local_store._allocator import aligned
from sglang_simm.local_store._index import StoreIndex
from sglang_simm.local_store._limits import StoreLimits
from sglang_simm.local_store._segments import OwnSegment, Segment, segment_bytes
from sglang_simm.local_store._table import IndexTable
from sglang_simm.simm_rules import OK

pytestmark = []  # pure: no store process, files in a temporary directory

ROWS, CAPACITY = 8, 12 * 1024
LIMITS = StoreLimits(max_clients=ROWS, max_grants_per_connection=4, max_objects=64, client_share=0.5)
SIZES = st.sampled_from([64, 500, 1000, 2048, 4000])
KEYS = [f"k{i}".encode() for i in range(10)]


@dataclass
class Copy:
    """A copy a client may be doing: it may touch ``extents`` (generation,
    start, end), writing (a put) or reading."""

    write: bool
    store: int  # the store process (its number) that granted it
    owner: int  # the connection
    grant: int = 0
    extents: list[tuple[str, int, int]] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


@dataclass
class Client:
    pid: int
    alive: bool = True
    stopped: bool = False
    conn: tuple[int, int] | None = None  # (store number, connection id)
    copies: list[Copy] = field(default_factory=list)
    busy: dict[int, int] = field(default_factory=dict)  # store number -> copies in flight (its row)


class Broken:
    """The rule broken on purpose, one way at a time."""

    grant_in_earlier = False  # the new store allocates in the last store's segment
    release_before_quiet = False  # earlier segments given back before their clients are done
    generations_from_one = False  # generations counted from 1 on every fresh start


class MemoryModel(RuleBasedStateMachine):
    broken = Broken()

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="memory-model-", dir=os.environ.get("TMPDIR"))
        self.stores: list[StoreIndex] = []  # every store process so far, by number
        self.gens: list[str] = []
        self.ids: set[int] = set()
        self.punched: list[tuple[str, int, int]] = []
        self.clients = [Client(pid=1000 + i) for i in range(3)]
        self.next_pid, self.next_conn = itertools.count(2000), itertools.count(1)
        self.table: IndexTable | None = None
        self.violation = ""
        self._start(fresh=True)

    # -- store processes ----------------------------------------------------------------

    def _new_gen(self, fresh: bool) -> str:
        if self.broken.generations_from_one and fresh:
            return f"{len(self.gens) % 2 + 1:016x}"  # repeats across fresh starts
        return os.urandom(8).hex()

    def _start(self, *, fresh: bool) -> None:
        """A store process starts: after a discard (``fresh``: nothing kept) or
        taking over what the last one left (crash, stop, idle exit on a disk)."""
        if self.table is not None:
            self.table.close(unlink=fresh)
        if fresh:
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))  # the files go; a client's mapping keeps its bytes
        earlier = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".seg"):
                seg = Segment.open(os.path.join(self.dir, name), name[:-4])
                seg.quiet = self._quiet_check(seg)
                seg.punch = self._recording_punch(seg)
                earlier.append(seg)
        gen = self._new_gen(fresh)
        path = os.path.join(self.dir, f"{gen}.seg")
        if self.broken.grant_in_earlier and earlier:
            own = OwnSegment(path.replace(gen, earlier[-1].gen), earlier[-1].fd, earlier[-1].gen, ROWS,
                             earlier[-1].data_start, earlier[-1].size, earlier[-1].boot)
            earlier = earlier[:-1]
            gen = own.gen
        else:
            if os.path.exists(path):
                os.unlink(path)
            own = OwnSegment.create(path, gen, segment_bytes(CAPACITY, ROWS), ROWS)
        self.gens.append(gen)
        self.table = IndexTable(os.path.join(self.dir, "index"), LIMITS.objects_for(CAPACITY), adopt=True)
        found, _ = self.table.recover({int(s.gen, 16): (s.data_start, s.size) for s in earlier})
        index = StoreIndex(capacity=CAPACITY, table=self.table, own=own, earlier=earlier, limits=LIMITS)
        index.recover(found)
        if self.broken.release_before_quiet:
            for seg in earlier:
                seg.quiet = lambda: True
        self.stores.append(index)
        index.release_earlier()
        for client in self.clients:
            client.conn = None  # every connection went with the old store

    def _quiet_check(self, seg: Segment):
        """``Segment.quiet`` with the model's processes for the real ones."""
        number = self.gens.index(seg.gen) if seg.gen in self.gens else -1

        def quiet() -> bool:
            return all(not c.alive or c.busy.get(number, 0) == 0 for c in self.clients)

        return quiet

    def _recording_punch(self, seg: Segment):
        real = seg.punch

        def punch(extents):
            self.punched += [(seg.gen, lo, hi) for lo, hi in extents]
            real(extents)

        return punch

    @property
    def store(self) -> StoreIndex:
        return self.stores[-1]

    @property
    def number(self) -> int:
        return len(self.stores) - 1

    # -- client processes -----------------------------------------------------------------

    def _client(self, i: int) -> Client | None:
        client = self.clients[i % len(self.clients)]
        return client if client.alive and not client.stopped else None

    def _connect(self, client: Client) -> int:
        if client.conn is None or client.conn[0] != self.number:
            client.conn = (self.number, next(self.next_conn))
        return client.conn[1]

    def _segment_gen(self, segi: int) -> str:
        return self.store.segs[segi].seg.gen

    @rule(i=st.integers(0, 2), sizes=st.lists(SIZES, min_size=1, max_size=3), k=st.integers(0, 9))
    def put(self, i, sizes, k):
        client = self._client(i)
        if client is None:
            return
        owner = self._connect(client)
        client.busy[self.number] = client.busy.get(self.number, 0) + 1  # before the request, as _maps.Busy
        keys = [KEYS[(k + j) % len(KEYS)] for j in range(len(sizes))]
        grant, codes, offsets = self.store.begin_put(owner, client.pid, keys, sizes, True)
        copy = Copy(True, self.number, owner, grant, keys=keys)
        gen = self._segment_gen(0)
        copy.extents = [(gen, o, o + aligned(s)) for o, s, c in zip(offsets, sizes, codes) if c == OK]
        self._granted(grant)
        client.copies.append(copy)

    @rule(i=st.integers(0, 2), k=st.integers(0, 9), n=st.integers(1, 3))
    def get(self, i, k, n):
        client = self._client(i)
        if client is None:
            return
        owner = self._connect(client)
        client.busy[self.number] = client.busy.get(self.number, 0) + 1
        keys = [KEYS[(k + j) % len(KEYS)] for j in range(n)]
        grant, results, segis, offsets, _ = self.store.begin_get(owner, client.pid, keys, [1 << 20] * n)
        copy = Copy(False, self.number, owner, grant, keys=keys)
        copy.extents = [(self._segment_gen(s), o, o + aligned(r)) for r, s, o in zip(results, segis, offsets)
                        if r >= 0]
        self._granted(grant)
        client.copies.append(copy)

    def _granted(self, grant: int) -> None:
        if grant:
            if grant in self.ids:
                self.violation = f"grant id {grant} granted twice"
            self.ids.add(grant)

    @rule(i=st.integers(0, 2))
    def finish(self, i):
        """A client's oldest copy is over: it commits or releases, if its
        connection is still the live store's."""
        client = self._client(i)
        if client is None or not client.copies:
            return
        copy = client.copies.pop(0)
        client.busy[copy.store] -= 1
        live = client.conn == (copy.store, copy.owner) and copy.store == self.number
        if live and copy.grant:
            if copy.write:
                self.store.commit_put(copy.owner, copy.grant, [0] * len(copy.extents))
            else:
                self.store.release(copy.owner, copy.grant)

    @rule(i=st.integers(0, 2))
    def lose_connection(self, i):
        client = self.clients[i % len(self.clients)]
        if client.alive and client.conn is not None and client.conn[0] == self.number:
            self.store.close_owner(client.conn[1], client.pid)
            client.conn = None

    @rule(i=st.integers(0, 2))
    def kill(self, i):
        client = self.clients[i % len(self.clients)]
        if client.alive:
            if client.conn is not None and client.conn[0] == self.number:
                self.store.close_owner(client.conn[1], client.pid)
            client.alive, client.copies, client.conn = False, [], None
            self.clients[i % len(self.clients)] = Client(pid=next(self.next_pid))  # another takes its place

    @rule(i=st.integers(0, 2))
    def stop_or_resume(self, i):
        client = self.clients[i % len(self.clients)]
        client.stopped = not client.stopped

    @rule(i=st.integers(0, 2))
    def fork(self, i):
        """A child of a client: it inherits no mapping, no connection, no copy."""
        parent = self.clients[i % len(self.clients)]
        if parent.alive and len(self.clients) < 6:
            self.clients.append(Client(pid=next(self.next_pid)))

    @rule()
    def housekeeping(self):
        def alive(pid):
            return any(c.pid == pid and c.alive for c in self.clients)

        def busy(pid):
            return next(c.busy.get(self.number, 0) for c in self.clients if c.pid == pid)

        self.store.end_orphans(busy, alive)
        self.store.release_earlier()

    @rule(how=st.sampled_from(["crash", "stop", "idle exit on disk", "fresh"]))
    def restart(self, how):
        if len(self.stores) < 6:
            self._start(fresh=how == "fresh")

    # -- the rule -----------------------------------------------------------------------

    @invariant()
    def no_byte_of_a_live_copy_is_anyone_elses(self):
        if self.violation:
            raise AssertionError(self.violation)
        copies = [(c, copy) for c in self.clients if c.alive for copy in c.copies]
        index = self.store
        live = index._keys.slots().tolist()
        published = [(index.segs[index.segi[s]].seg.gen, int(self.table.offset[s]),
                      int(self.table.offset[s]) + aligned(int(self.table.size[s]))) for s in live]
        for n, (client, copy) in enumerate(copies):
            for gen, lo, hi in copy.extents:
                for other_client, other in copies[n + 1:]:
                    if not (copy.write or other.write):
                        continue
                    for g, a, b in other.extents:
                        assert not (g == gen and a < hi and lo < b), (
                            f"pid {client.pid}'s copy and pid {other_client.pid}'s share bytes [{max(a, lo)}, "
                            f"{min(b, hi)}) of segment {gen}, one of them writing")
                if copy.write:
                    for g, a, b in published:
                        assert not (g == gen and a < hi and lo < b), (
                            f"pid {client.pid} may still write bytes of a published object in segment {gen}")
                for g, a, b in self.punched:
                    assert not (g == gen and a < hi and lo < b), (
                            f"bytes of segment {gen} pid {client.pid} may still touch were given back")
        self.punched = [p for p in self.punched if any(
            g == p[0] for c, copy in copies for g, _, _ in copy.extents)]

    def teardown(self) -> None:
        import shutil

        if self.table is not None:
            self.table.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(broken: Broken, examples: int) -> None:
    MemoryModel.broken = broken
    test = MemoryModel.TestCase
    test.settings = settings(max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True,
                             phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    test("runTest").runTest()


def test_no_byte_a_live_client_may_touch_is_anyone_elses():
    _run(Broken(), 300)


@pytest.mark.parametrize("way", ["grant_in_earlier", "release_before_quiet", "generations_from_one"])
def test_the_model_finds_the_wrong_bytes_of_each_way_of_breaking_the_rule(way):
    broken = Broken()
    setattr(broken, way, True)
    with pytest.raises(AssertionError, match="share bytes|published object|given back|granted twice"):
        _run(broken, 300)
