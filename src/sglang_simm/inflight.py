"""Which host pools are bound, and which data-path calls are using each.

Every data-path method runs its body in ``with Call(fault, where) as
call``: ``pools.use(call, name)`` hands it a pool counted in, leaving the
block counts it out, and an exception in the body is a fault, handed to
``fault`` and swallowed, so the method answers its misses after the block
(the error contract on ``backend.HiCacheSiMM``). The call also holds the
breaker's permit (``allow``, ``record``).

A retired pool (replaced by a re-registration, or the backend closed) is
deregistered by ``release`` once *its* calls are over, by a background
thread where some are in flight: a data-path thread only sets the pool's
``drained`` event on its way out, so no call pays for another pool's
deregistration.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from sglang_simm.breaker import fault_of
from sglang_simm.errors import BackendClosedError
from sglang_simm.hybrid import KV

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.binding import PoolBinding
    from sglang_simm.breaker import Breaker, Permit

logger = logging.getLogger("sglang_simm.backend")


class Call:
    """The context of one data-path call (the module docstring says what it keeps)."""

    __slots__ = ("_fault", "where", "_breaker", "used", "permit", "faulted")

    def __init__(self, fault: Callable[[str, BaseException], None], where: str,
                 breaker: Breaker | None = None) -> None:
        self._fault = fault
        #: the method's name, for faults, logs and the breaker's reports
        self.where = where
        self._breaker = breaker
        #: the pools this call is counted in on
        self.used: list[PoolBinding] = []
        #: the breaker's leave for the client call under way (None: none asked)
        self.permit: Permit | None = None
        #: whether a client call of this call was a fault (the breaker's verdict)
        self.faulted = False

    def __enter__(self) -> Call:
        return self

    def allow(self) -> bool:
        """Leave to make the next client call: False while the breaker is
        open (or a probe is in flight), and after a client call of this
        call was a fault (a hung store must not cost one call two time
        limits). Ask before resolving or allocating anything, so a refused
        call holds no pool and no host memory."""
        if self.faulted:
            return False
        if self._breaker is None:
            return True
        permit = self._breaker.allow()
        if not permit:
            return False
        self.permit = permit
        return True

    def record(self, codes: Iterable[int] = (), seconds: float = 0.0, *,
               exc: BaseException | None = None) -> str | None:
        """Tell the breaker what the client call answered (its codes and
        time, or the exception it raised and the caller handled); the
        fault's cause, or None for a healthy answer."""
        permit = self.permit
        if permit is None:
            return None
        if exc is not None:
            cause = fault_of(exc=exc)
            permit.release(exc, op=self.where)
        else:
            cause = permit.record(codes, seconds=seconds, op=self.where)
        if cause is not None:
            self.faulted = True
        return cause

    def use(self, binding: PoolBinding | None) -> PoolBinding | None:
        """``binding``, counted in for the rest of the call; None when there
        is none or it was retired (the call then has nothing to use)."""
        if binding is None or not binding.enter():
            return None
        self.used.append(binding)
        return binding

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        for b in self.used:
            b.leave()
        if self.permit is not None:
            self.permit.release(exc, op=self.where)
        if isinstance(exc, Exception):
            self._fault(self.where, exc)
            return True  # the caller answers misses after the block
        return False


class Pools:
    """The host pools bound to one backend (``kv``, and the hybrid ``side``
    pools by name), and whether it is ``closed``. Attach and close change
    them under ``lock``; data-path threads read them without it (a read is
    atomic) and count themselves in on the binding they get (``use``), so
    no pool is deregistered under a call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self.kv: PoolBinding | None = None
        self.side: dict[str, PoolBinding] = {}
        #: a KV anchor that holds no KV (DeepSeek V4's logical pool), bound
        #: instead of ``kv``: nothing to store for it, hits from side pools
        self.logical: Any = None
        #: side pools left out of L3 (``PoolLeftOutError``), by name: why
        self.left_out: dict[str, str] = {}

    def get(self, name: str) -> PoolBinding | None:
        """The pool bound as ``name`` (``hybrid.KV``: the KV pool), or None."""
        return self.kv if name == KV else self.side.get(name)

    def bound(self) -> list[tuple[str, PoolBinding]]:
        """Every bound pool by name, the KV pool first."""
        kv = [(KV, self.kv)] if self.kv is not None else []
        return kv + sorted(self.side.items())

    def use(self, call: Call, name: str) -> PoolBinding | None:
        """The pool bound as ``name``, counted in on ``call``; None when none
        is bound (or the backend is closed)."""
        return call.use(self.get(name)) or call.use(self.get(name))  # again if replaced since read

    def check_open(self, where: str) -> None:
        if self.closed:
            raise BackendClosedError(
                f"{where}: this HiCacheSiMM backend is closed; SGLang attaches a new backend "
                "(create_backend) instead of reusing a closed one"
            )

    def install(self, name: str, binding: PoolBinding, where: str) -> PoolBinding | None:
        """Make ``binding`` the pool bound as ``name``; the one it replaces,
        if any (for the caller to ``release``). A backend closed meanwhile
        refuses it: it is closed and BackendClosedError raised."""
        old = None
        with self.lock:
            closed = self.closed
            if not closed:
                old = self.get(name)
                if name == KV:
                    self.kv, self.logical = binding, None
                else:
                    self.side[name] = binding
                    self.left_out.pop(name, None)
        if closed:
            binding.close()
            self.check_open(where)
        return old

    def install_logical(self, pool: Any, where: str) -> PoolBinding | None:
        """Make ``pool``, a logical KV anchor, the KV pool: no binding; the
        KV binding it replaces, if any (for the caller to ``release``)."""
        with self.lock:
            self.check_open(where)
            old, self.kv, self.logical = self.kv, None, pool
        return old

    def leave_out(self, name: str, why: str, where: str) -> PoolBinding | None:
        """Record side pool ``name`` as left out; the binding it replaces."""
        with self.lock:
            self.check_open(where)
            old = self.side.pop(name, None)
            self.left_out[name] = why
        return old

    def close(self) -> list[PoolBinding] | None:
        """Mark closed and unbind every pool; the pools that were bound, or
        None when already closed."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            bindings = [b for _, b in self.bound()]
            self.kv, self.side, self.logical = None, {}, None
        return bindings


def release(
    bindings: Sequence[PoolBinding],
    *,
    wait_s: float = 0.0,
    then: Callable[[], Any] | None = None,
    what: str = "a replaced host pool",
) -> bool:
    """Retire ``bindings``; deregister each once none of its calls is in
    flight, then run ``then`` (closing the client), in that order always.
    Waits up to ``wait_s`` here, then leaves the rest to a background
    thread; True when everything was done here."""
    for b in bindings:
        b.retire()
    if all(b.drained.wait(wait_s) for b in bindings):
        _finish(bindings, then, what)
        return True
    busy = sum(not b.drained.is_set() for b in bindings)
    logger.warning("SiMM: %d host pool(s) of %s still in use by data-path calls; their memory "
                   "is deregistered%s once those calls end", busy, what,
                   " and the client closed" if then is not None else "")
    threading.Thread(target=_finish_when_drained, args=(list(bindings), then, what),
                     name="sglang-simm-release", daemon=True).start()
    return False


def _finish_when_drained(bindings: list[PoolBinding], then: Callable[[], Any] | None, what: str) -> None:
    for b in bindings:
        b.drained.wait()
    _finish(bindings, then, what)


def _finish(bindings: Sequence[PoolBinding], then: Callable[[], Any] | None, what: str) -> None:
    for b in bindings:
        try:
            b.close()
        except Exception as exc:  # deregistration failed: log, keep going
            logger.warning("SiMM: deregistering %s failed: %s: %s", what, type(exc).__name__, exc)
    if then is not None:
        try:
            then()
        except Exception as exc:
            logger.warning("SiMM: closing the client failed: %s: %s", type(exc).__name__, exc)
