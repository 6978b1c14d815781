"""One data-path call: the pools it uses, counted in and out, and its faults.

Every data-path method runs its body in ``with Call(backend, where) as
call``: ``call.use(binding)`` counts the call in on a pool (None once the
pool is retired), and leaving the block counts it out of every pool it
used, whatever happened. An exception in the body is a fault: counted by
type, logged rate-limited, and swallowed, so the method goes on to answer
its misses after the block. SGLang's storage threads die on an exception;
a False is only a miss.

A retired pool (replaced by a re-registration, or the backend closed) is
deregistered by ``release`` once *its* calls are over: at once when none
is in flight, otherwise by a background thread that waits for them. A
data-path thread only sets the pool's ``drained`` event on its way out,
so no call ever pays for another pool's deregistration.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.binding import PoolBinding

logger = logging.getLogger("sglang_simm.backend")


class Call:
    """The context of one data-path call (see the module docstring)."""

    __slots__ = ("_fault", "_where", "one", "more")

    def __init__(self, fault: Callable[[str, BaseException], None], where: str) -> None:
        self._fault = fault
        self._where = where
        #: the first pool used (nearly every call uses one), then the rest
        self.one: PoolBinding | None = None
        self.more: list[PoolBinding] | None = None

    def __enter__(self) -> Call:
        return self

    def use(self, binding: PoolBinding | None) -> PoolBinding | None:
        """``binding``, counted in for the rest of the call; None when there
        is none or it was retired (the call then has nothing to use)."""
        if binding is None or not binding.enter():
            return None
        if self.one is None:
            self.one = binding
        elif self.more is None:
            self.more = [binding]
        else:
            self.more.append(binding)
        return binding

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.one is not None:
            self.one.leave()
            if self.more is not None:
                for b in self.more:
                    b.leave()
        if exc is not None and isinstance(exc, Exception):
            self._fault(self._where, exc)
            return True  # the caller answers misses after the block
        return False


def release(
    bindings: Sequence[PoolBinding],
    *,
    wait_s: float = 0.0,
    then: Callable[[], Any] | None = None,
    what: str = "a replaced host pool",
) -> bool:
    """Retire ``bindings``; deregister each once none of its calls is in
    flight, then run ``then`` (closing the client), in that order always.

    Waits up to ``wait_s`` here; what is still in use then is finished by a
    background thread once its calls end. True when everything was done
    here."""
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
