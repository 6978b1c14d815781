"""Put room a host-store client holds, so that a small backup waits for no reply.

A backup normally asks the store process for room (PUT), copies, and
publishes (COMMIT, whose reply is read later). The PUT's reply is the one
wait: a round trip that, beside a busy scheduler on a small machine, waits
for the store process to get a core and then for the GIL. So a connection
also holds a *room*: extents of one object size the store reserved for it
in advance (RESERVE). A backup that fits copies into some of them and
publishes them with one COMMIT_ROOM, sent and not waited for; when the
room runs low the next one is asked for, again without waiting.

This module is the bookkeeping (no I/O): which room a batch goes to, when
to ask, when a room is too old to trust. The store renews a room's lease
on every COMMIT_ROOM and ends it after ``lease_timeout_s`` without one, so
a room is used only within half that time of the last message that
renewed it (the store's clock reads that message later than this side
sent it: its lease is younger than ours by that much). The caller holds
the connection's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: Rooms one connection holds at most: the one it fills and the next
#: (the store refuses a third, ``_daemon.ROOMS_PER_CONNECTION``).
MAX_ROOMS = 2
#: After the store granted no room (full, or refused), ask again after this.
ASK_AGAIN_S = 1.0
#: A batch goes into a room only if it needs at most 1 / this of one.
ROOM_SHARE_PER_BATCH = 4


@dataclass
class Room:
    lease: int
    size: int  # every extent's size: objects of exactly this size go here
    free: list[int]  # offsets not used yet, lowest first
    fresh_until: float  # monotonic time past which the store may have ended it
    #: backups copying into it now: it is given back (ABORT frees all its
    #: unpublished extents) only once none is
    copying: int = 0
    #: taken out of use: given back when the last copy into it is done
    retired: bool = False


@dataclass(frozen=True)
class Ask:
    """A RESERVE sent, its reply not read yet (kept in the connection's
    queue of replies due)."""

    size: int
    count: int
    sent: float


@dataclass(frozen=True)
class RoomCommit:
    """A COMMIT_ROOM sent, its reply not read yet: how many entries it
    publishes, into which room."""

    entries: int
    room: Room


def entries_due(pending: object) -> int:
    """Entries a reply due publishes (an ``Ask`` publishes none)."""
    if isinstance(pending, RoomCommit):
        return pending.entries
    return 0 if isinstance(pending, Ask) else int(pending)  # type: ignore[call-overload]


@dataclass
class Rooms:
    """One connection's rooms. ``room_bytes``: the largest room the store
    grants (0: none), ``room_entries`` the most extents in one;
    ``lease_timeout_s``: its lease time limit."""

    room_bytes: int
    room_entries: int
    lease_timeout_s: float
    clock: Callable[[], float] = time.monotonic
    rooms: list[Room] = field(default_factory=list)
    asking: Ask | None = None
    _ask_after: float = 0.0

    def count_for(self, size: int) -> int:
        """Extents of ``size`` bytes a room holds (0: too big for rooms)."""
        if size <= 0 or not self.room_bytes:
            return 0
        count = min(self.room_bytes // size, self.room_entries)
        return count if count >= 2 else 0

    def take(self, size: int, n: int) -> tuple[Room, list[int]] | None:
        """``n`` extents of ``size`` bytes from one fresh room, or None. A
        batch of more than a quarter of a room asks for its own: its copy
        outweighs the round trip, and a room drained by big backups would
        send the small ones, whose time is the round trip, the slow way."""
        if n * ROOM_SHARE_PER_BATCH > self.count_for(size):
            return None
        now = self.clock()
        for room in self.rooms:
            if room.size == size and len(room.free) >= n and now < room.fresh_until:
                offsets = room.free[:n]
                del room.free[:n]
                room.copying += 1
                return room, offsets
        return None

    def renewed(self, room: Room, sent: float) -> list[Room]:
        """A copy into ``room`` is done and its COMMIT_ROOM was sent at
        ``sent``: the rooms to give back now. A used-up room is gone (the
        store ends its lease at its last commit)."""
        room.copying -= 1
        room.fresh_until = sent + self.lease_timeout_s / 2
        if room.retired:
            return [room] if room.copying == 0 else []
        if not room.free and room in self.rooms:
            self.rooms.remove(room)
        return []

    def failed(self, room: Room) -> list[Room]:
        """A copy into ``room`` failed: its extents are neither filled nor
        free, so the room goes (given back once no other copy is in it)."""
        room.copying -= 1
        return self._retire(room)

    def lost(self, room: Room) -> None:
        """The store refused a commit into ``room`` (it ended: expired, or
        the capacity changed): not used again."""
        self._retire(room)  # nothing to give back: the store ended it

    def stale(self) -> list[Room]:
        """Rooms too old to use are taken out: those to give back now."""
        now = self.clock()
        out: list[Room] = []
        for room in [room for room in self.rooms if now >= room.fresh_until]:
            out += self._retire(room)
        return out

    def _retire(self, room: Room) -> list[Room]:
        """No more backups into ``room``; ``[room]`` when it can be given
        back now: another thread's copy into it may be in flight, and
        giving it back frees every extent it has not published."""
        if room in self.rooms:
            self.rooms.remove(room)
        room.retired = True
        return [room] if room.copying == 0 else []

    def ask(self, size: int) -> tuple[Ask | None, list[Room]]:
        """A RESERVE to send now for objects of ``size`` bytes (None: one is
        in flight, the store granted none a moment ago, or what is free for
        this size is still half a room or more), and the rooms to give back
        first to stay within ``MAX_ROOMS``: those of other sizes (a model's
        pages are of one size; a one-off put of another size, such as a
        backend's warm-up, must not keep a room from them), else the one
        of this size with the least left."""
        count = self.count_for(size)
        if not count or self.asking is not None:
            return None, []
        now = self.clock()
        if now < self._ask_after:
            return None, []
        if sum(len(room.free) for room in self.rooms if room.size == size) * 2 >= count:
            return None, []
        drop: list[Room] = []
        if len(self.rooms) >= MAX_ROOMS:
            others = [room for room in self.rooms if room.size != size]
            drop = self._retire(min(others or self.rooms, key=lambda room: len(room.free)))
        self.asking = Ask(size, count, now)
        return self.asking, drop

    def granted(self, ask: Ask, lease: int, offsets: list[int]) -> None:
        """The store's answer to ``ask``: a room (lease 0, or no offsets: none)."""
        self.asking = None
        if not lease or not offsets:
            self._ask_after = self.clock() + ASK_AGAIN_S
            return
        self.rooms.append(Room(lease, ask.size, sorted(offsets), ask.sent + self.lease_timeout_s / 2))

    def refused(self) -> None:
        """The store answered the ask with an error: ask again later."""
        self.asking = None
        self._ask_after = self.clock() + ASK_AGAIN_S
