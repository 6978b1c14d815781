"""The local store's limits: every resource a client can make it spend.

A store process serves every process of its user on the host, for weeks,
and treats each socket as hostile until checked. Each limit here is a
setting with a default an operator can leave alone; past it the store
refuses with a SiMM code, logs (rate-limited) and counts the refusal by
reason (``refused_<reason>`` in ``store status`` and the Prometheus text).

Private memory (outside the arena) is bounded by these settings alone:

* the index: about ``INDEX_BYTES_PER_OBJECT`` per object, and at most
  ``max_objects`` objects (past it puts evict the oldest, as past the
  byte capacity);
* buffered requests: at most ``max_frame_bytes`` per connection and
  ``input_budget_bytes`` over all of them (a connection past either is
  dropped);
* unanswered replies: a connection's requests are not read while more
  than ``reply_backlog_bytes`` of its replies wait unread (the kernel then
  stops the peer), so at most that plus one reply per connection;
* ``max_connections`` connections, ``max_leases`` open leases.

Pure data and arithmetic; no I/O.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from collections.abc import Sequence
from typing import Any

from sglang_simm.embedded.simm_rules import MAX_KEY_BYTES, MAX_VALUE_BYTES

#: What one object costs the store process in private memory (key bytes
#: aside): its index entry, the ordered dict's node, the lease bookkeeping.
#: Measured at ~430 bytes on CPython 3.11; rounded up.
INDEX_BYTES_PER_OBJECT = 512

#: Why a request or connection was refused: the ``refused_<reason>`` counters.
REFUSALS = (
    "connections",  # max_connections reached
    "fds",  # accept() failed with EMFILE/ENFILE
    "frame",  # a frame above max_frame_bytes (connection dropped)
    "input_budget",  # buffered requests over input_budget_bytes (connection dropped)
    "batch",  # more entries than max_batch
    "key",  # a key above 256 bytes
    "size",  # a value size below 0 or above SiMM's limit
    "lease_owner",  # COMMIT/RELEASE/ABORT of another connection's lease, FENCE of another process's
    "leases",  # max_leases open leases, or a connection's own limits (count, share of the capacity)
    "bad_frame",  # a malformed frame (connection dropped)
    "request",  # a request that parses into fields of the wrong type or out of range (InvalidArgument)
    "hello",  # a connection that said no HELLO within the deadline (dropped)
)


@dataclass(frozen=True)
class StoreLimits:
    """The store process's limits (``store start`` options, persisted with
    the store's settings)."""

    max_connections: int = 1024
    """Connections at once; lowered at start to what the fd limit allows."""

    max_frame_bytes: int = 8 << 20
    """Largest request frame (a batch of ``max_batch`` 256-byte keys fits)."""

    input_budget_bytes: int = 64 << 20
    """Unfinished request bytes buffered over all connections."""

    reply_backlog_bytes: int = 256 << 10
    """Unread reply bytes past which a connection's requests wait."""

    max_batch: int = 16384
    """Entries in one request; clients split larger batches."""

    max_objects: int = 0
    """Objects at once; 0: one per 4 KiB of capacity, at least 65,536."""

    max_leases: int = 65536
    """Open leases (batches being copied) at once."""

    max_leases_per_connection: int = 64
    """Open leases one connection may hold (a client's threads each copy
    under one at a time): a stopped or misbehaving client holds no more."""

    idle_exit_s: float = 0.0
    """Exit (freeing the shared memory) after this long with no client; 0: never."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"store limit {f.name} must be a number, got {value!r}")
            floor = 0 if f.name in ("max_objects", "idle_exit_s") else 1
            if value < floor:
                raise ValueError(f"store limit {f.name} must be >= {floor}, got {value!r}")
        if self.max_frame_bytes < 1 << 16:
            raise ValueError(f"store limit max_frame_bytes must be >= 65536, got {self.max_frame_bytes}")

    def objects_for(self, capacity: int) -> int:
        return self.max_objects or max(capacity // 4096, 65536)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreLimits:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def key_ok(key: bytes) -> bool:
    return len(key) <= MAX_KEY_BYTES


def size_ok(size: int) -> bool:
    return 0 <= size <= MAX_VALUE_BYTES


#: Warm-up key prefixes a store keeps at most (clients declare them; each
#: at most SiMM's key length).
MAX_WARMUP_PREFIXES = 16


def check_warmup_prefix(prefix: object, held: Sequence[object]) -> None:
    """Raise ValueError unless ``prefix`` (``str`` or ``bytes``) may be added
    to the ``held`` ones: a key (not empty, no NUL, at most SiMM's key
    length), and room for one more unless it is held already."""
    raw = prefix.encode("utf-8", "surrogatepass") if isinstance(prefix, str) else prefix
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_KEY_BYTES or b"\0" in raw:
        raise ValueError(f"a warm-up key prefix must be a key of 1 to {MAX_KEY_BYTES} bytes without NUL, "
                         f"got {prefix!r}")
    if prefix not in held and len(held) >= MAX_WARMUP_PREFIXES:
        raise ValueError(f"at most {MAX_WARMUP_PREFIXES} warm-up key prefixes, and {len(held)} are held")


class RateLimitedLog:
    """At most one line per reason per ``every_s``, saying how many were
    suppressed since the last one: a peer flooding bad requests cannot fill
    the disk or drown the other lines."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._logger = logger
        self._every = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, reason: str, msg: str, *args: object) -> None:
        self._log(logging.WARNING, reason, msg, *args)

    def info(self, reason: str, msg: str, *args: object) -> None:
        self._log(logging.INFO, reason, msg, *args)

    def _log(self, level: int, reason: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(reason, -self._every) < self._every:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        self._last[reason] = now
        quiet = self._quiet.pop(reason, 0)
        if quiet:
            msg += f" ({quiet} more like it in the last {self._every:.0f} s)"
        self._logger.log(level, msg, *args)
