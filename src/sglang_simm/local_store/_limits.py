"""Every resource a client can make the store spend, and its limit.

A store process serves every process of its user on the host, for weeks,
and treats each socket as hostile until checked. Past a limit it answers a
SiMM code, logs one line per reason per 10 s and counts the refusal
(``refused_<reason>`` in ``store status`` and the Prometheus text); it never
exits. Its private memory is bounded by these settings alone (the index
per object: docs/local-store.md, "Limits").
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

EVICTION_POLICIES = ("fifo", "lru")


def check_policy(policy: object) -> str:
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    return policy  # type: ignore[return-value]


#: Why a request or connection was refused: the ``refused_<reason>`` counters.
REFUSALS = (
    "connections",  # max_connections reached
    "clients",  # max_clients processes with data connections
    "fds",  # accept() failed with EMFILE/ENFILE
    "frame",  # a frame above max_frame_bytes (connection dropped)
    "input_budget",  # buffered requests over input_budget_bytes (connection dropped)
    "batch",  # more entries than max_batch
    "key",  # a key above 256 bytes
    "size",  # a value size below 0 or above SiMM's limit
    "grant_owner",  # COMMIT/ABORT/RELEASE of a grant the connection does not hold
    "grants",  # max_grants_per_connection, or the client's share of the capacity
    "bad_frame",  # a malformed frame (connection dropped)
    "request",  # fields of the wrong type or out of range (InvalidArgument)
    "hello",  # no HELLO within the deadline (dropped)
)


@dataclass(frozen=True)
class StoreLimits:
    """The store process's limits (``store start`` options, kept in its settings)."""

    max_connections: int = 1024
    """Connections at once; lowered at start to what the fd limit allows."""

    max_clients: int = 1024
    """Client processes with data connections at once (rows of the segment's
    client table); a process past it is refused at its handshake."""

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

    max_grants_per_connection: int = 64
    """Open grants (puts being copied, reads being copied) per connection."""

    client_share: float = 0.25
    """Share of the capacity one client process may hold in grants and pins
    at once (at least one object of SiMM's largest size): what a stopped or
    slow client can keep from the others."""

    idle_exit_s: float = 0.0
    """Exit after this long with no client; 0: never."""

    removals_kept: int = 65536
    """Removals (keys evicted or deleted, prefixes cleared) kept for the
    clients that follow them (``Store.removed_since``); one that falls
    further behind is told it lost some."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"store limit {f.name} must be a number, got {value!r}")
            floor = 0 if f.name in ("max_objects", "idle_exit_s") else 1 if f.type == "int" else 0.01
            if value < floor or (f.name == "client_share" and value > 1):
                bound = f">= {floor}" + (" and <= 1" if f.name == "client_share" else "")
                raise ValueError(f"store limit {f.name} must be {bound}, got {value!r}")
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


class RateLimitedLog:
    """At most one line per reason per ``every_s``, saying how many were
    suppressed since: a peer flooding bad requests cannot fill the disk."""

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
