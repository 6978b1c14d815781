"""Fault injection for the local store: a wrapper, installed only when asked.

A :class:`FaultyServer` stands in front of one store (a ``StoreServer``)
and plays the network between this process and it: an outage (``down``),
added latency (``latency_us``), per-entry failures (``error_rate`` of the
entries fail with ``error_code``), and corrupt reads (``corrupt_rate``).
Storage never sees it; the servers know nothing of faults.

A :class:`Link` is the route from this process's clients to one store:
its ``server`` is the store itself while no fault is set, and a
``FaultyServer`` around it while one is. Clients of a store share its link
and read ``link.server`` once per call, so a fault set at run time reaches
every client at once, and with no fault set no fault code runs on the data
path.

Injected failures stand for transport failures (an RPC that timed out or
could not be sent): the real client returns those codes unchanged on every
path, sync and async alike, while it maps the store's own refusals per
path. So the wrapper keeps them apart: a whole-batch outage raises
``StoreUnreachable`` (as the host store does for a store process it cannot
reach), and a per-entry failure is an :class:`InjectedCode`, an ``int``
the client passes through. The default code is SendRPCFailed (-2300): at
SiMM's HEAD a timed-out or lost request surfaces as that code; the client
never produces Timeout (-1002) (``clnt_messenger.cc``, ``call_sync``).

``corrupt_rate`` is the one fault that is not a failure: a read that
succeeded has its destination's bytes flipped afterwards, as a bad NIC or a
bad DIMM would, and still reports success. It exists so that tests can check
that wrong bytes are visible downstream (a test that cannot fail is none).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_simm.embedded._copy import wrap_memory
from sglang_simm.embedded._host import StoreUnreachable
from sglang_simm.embedded.contract import StoreServer
from sglang_simm.embedded.simm_rules import SEND_RPC_FAILED, code_name

# -- the settings ------------------------------------------------------------------


def check_rate(value: object, name: str) -> float:
    """A share within 0..1 (``error_rate``, ``corrupt_rate``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    rate = float(value)
    if not 0.0 <= rate <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be within 0..1, got {value!r}")
    return rate


def check_code(value: object) -> int:
    """An injected code: the real client's codes are negative int16."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"error_code must be an int, got {value!r}")
    if not -32768 <= value <= -1:
        raise ValueError(f"error_code must be a negative int16 (-32768..-1), got {value!r}")
    return value


def check_non_negative(value: object, name: str) -> float:
    """A duration (``latency_us``, and the store's ``idle_exit_s``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not number >= 0.0:  # also rejects NaN
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


@dataclass(frozen=True)
class FaultSettings:
    """The simulated network to one store; the defaults inject nothing.

    Validated when made (TypeError, ValueError). Draws are deterministic
    when ``seed`` is set: the same sequence of calls on a fresh wrapper
    with the same seed fails the same entries.
    """

    #: Share of the entries that reach the network failing with ``error_code``.
    error_rate: float = 0.0
    error_code: int = SEND_RPC_FAILED
    #: Added to every call that reaches the network, in microseconds.
    latency_us: float = 0.0
    #: The store cannot be reached: calls fail with SendRPCFailed, ``Store()`` raises.
    down: bool = False
    #: Share of successful reads whose bytes are flipped (see the module docstring).
    corrupt_rate: float = 0.0
    #: The draws' seed; None: unseeded.
    seed: int | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalised once, here
        set_field(self, "error_rate", check_rate(self.error_rate, "error_rate"))
        set_field(self, "corrupt_rate", check_rate(self.corrupt_rate, "corrupt_rate"))
        check_code(self.error_code)
        set_field(self, "latency_us", check_non_negative(self.latency_us, "latency_us"))
        if not isinstance(self.down, bool):
            raise TypeError(f"down must be a bool, got {self.down!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def injects(self) -> bool:
        """Whether these settings change any call (the error code and the
        seed alone do not)."""
        return self.down or self.error_rate > 0.0 or self.latency_us > 0.0 or self.corrupt_rate > 0.0

    def describe(self) -> str:
        parts = []
        if self.down:
            parts.append("down")
        if self.error_rate:
            parts.append(f"error_rate={self.error_rate:g} error_code={code_name(self.error_code)}")
        if self.latency_us:
            parts.append(f"latency_us={self.latency_us:g}")
        if self.corrupt_rate:
            parts.append(f"corrupt_rate={self.corrupt_rate:g}")
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        return " ".join(parts) or "none"


class InjectedCode(int):
    """A code the simulated network answered in the store's place. The
    client passes it through on every path, as the real client passes a
    transport failure; only the store's own refusals are mapped per path."""

    __slots__ = ()


# -- the wrapper -------------------------------------------------------------------


class FaultyServer:
    """A ``StoreServer`` that reaches ``store`` through a faulty network.

    Data calls (``put_from``, ``get_into``, ``lookup``, ``delete``,
    ``delete_prefix``) go through the faults: while ``down`` they raise
    ``StoreUnreachable(SEND_RPC_FAILED)``; else they wait ``latency_us``,
    draw per entry (one draw per entry, in entry order, under a lock)
    whether it fails with ``error_code`` (an :class:`InjectedCode`; only
    the others reach the store), and after a get flip the chosen
    successful reads. Operator calls, and any attribute of the store's
    own (a host store's ``pid``, ``stop``, ...), go straight to ``store``.
    ``stats()`` adds ``injected_errors``: entries failed here.
    """

    def __init__(self, store: StoreServer, settings: FaultSettings) -> None:
        self.store = store
        self.settings = settings
        self._lock = threading.Lock()
        self._rng = random.Random(settings.seed)
        #: Entries failed so far (outage and error rate).
        self.injected = 0
        #: Reads corrupted so far.
        self.corrupted = 0

    def retune(self, settings: FaultSettings, *, reseed: bool) -> None:
        """New settings from the next call on; ``reseed`` restarts the draws
        from ``settings.seed``. The counters are kept."""
        with self._lock:
            if reseed:
                self._rng = random.Random(settings.seed)
            self.settings = settings

    # -- the network --------------------------------------------------------

    def _connect(self, entries: int) -> None:
        """Before a call of ``entries`` entries: raise when down (the
        entries counted as injected), else wait ``latency_us``."""
        settings = self.settings
        if settings.down:
            with self._lock:
                self.injected += entries
            raise StoreUnreachable(SEND_RPC_FAILED, f"local store {self.name!r} is down (local_store_down)")
        if settings.latency_us > 0.0:
            time.sleep(settings.latency_us / 1e6)  # releases the GIL

    def _draw(self, entries: int) -> list[int] | None:
        """Per entry, 0 (it goes through) or its injected code; None when
        every entry goes through (the common case)."""
        settings = self.settings
        rate = settings.error_rate
        if rate <= 0.0 or entries == 0:
            return None
        code = InjectedCode(settings.error_code)
        with self._lock:
            rnd = self._rng.random
            codes = [code if rnd() < rate else 0 for _ in range(entries)]
            failed = entries - codes.count(0)
            self.injected += failed
        return codes if failed else None

    def _through(self, items: Sequence, call) -> list[int]:
        """``call(items)`` for the entries the network lets through; the
        others answer their injected code."""
        self._connect(len(items))
        injected = self._draw(len(items))
        if injected is None:
            return call(items)
        passed = [item for item, code in zip(items, injected) if not code]
        answers = iter(call(passed) if passed else ())
        return [code or next(answers) for code in injected]

    def _corrupt(self, items: Sequence[tuple[str, int, int]], codes: list[int]) -> None:
        """Flip the top bit of every byte of the chosen successful reads'
        destinations. For IEEE floats of any width that flips a sign, an
        exponent or a mantissa bit of every value: all stay finite (barring
        values near the type's maximum), and all are wrong."""
        rate = self.settings.corrupt_rate
        reads = [(item[1], code) for item, code in zip(items, codes) if code > 0]
        if rate <= 0.0 or not reads:
            return
        with self._lock:
            rnd = self._rng.random
            chosen = [read for read in reads if rnd() < rate]
            self.corrupted += len(chosen)
        for ptr, size in chosen:
            wrap_memory(ptr, size).bitwise_xor_(0x80)

    # -- the data path ------------------------------------------------------

    def put_from(self, items: Sequence[tuple[str, int, int]], overwrite: bool) -> list[int]:
        return self._through(items, lambda passed: self.store.put_from(passed, overwrite))

    def get_into(self, items: Sequence[tuple[str, int, int]]) -> list[int]:
        codes = self._through(items, self.store.get_into)
        self._corrupt(items, codes)
        return codes

    def lookup(self, keys: Sequence[str]) -> list[int]:
        return self._through(keys, self.store.lookup)

    def delete(self, key: str) -> int:
        return self._through([key], lambda passed: [self.store.delete(passed[0])])[0]

    def delete_prefix(self, prefix: str) -> int:
        self._connect(1)  # one request; no per-entry draw, as it has no entries to fail
        return self.store.delete_prefix(prefix)

    # -- operator calls: the store's own ---------------------------------------

    @property
    def name(self) -> str:
        return self.store.name

    def clear(self) -> None:
        self.store.clear()

    def keys(self) -> list[str]:
        return self.store.keys()

    def stats(self) -> dict[str, int]:
        out = self.store.stats()
        out["injected_errors"] = self.injected
        return out

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    def set_capacity(self, capacity_bytes: int) -> None:
        self.store.set_capacity(capacity_bytes)

    def set_policy(self, policy: str) -> None:
        self.store.set_policy(policy)

    def add_warmup_prefix(self, prefix: str) -> None:
        self.store.add_warmup_prefix(prefix)

    def __getattr__(self, name: str) -> Any:
        # only for what this class lacks: the store's own extras
        if name == "store":  # not set yet (a half-made instance): no recursion
            raise AttributeError(name)
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"<FaultyServer {self.settings.describe()} around {self.store!r}>"


# -- the route ---------------------------------------------------------------------


class Link:
    """The route from this process's clients to one store.

    ``server`` is ``store`` itself while ``faults`` inject nothing, and a
    :class:`FaultyServer` around it while they do; ``configure`` swaps it.
    A wrapper kept across changes keeps its draws and counters; one taken
    away and installed again starts afresh. ``clients`` counts the open
    clients on this route; the last to leave drops a local store process's
    connection (the handle connects again on its next request).
    """

    __slots__ = ("_lock", "clients", "faults", "server", "store")

    def __init__(self, store: StoreServer, faults: FaultSettings) -> None:
        self._lock = threading.Lock()
        self.store = store
        self.faults = FaultSettings()
        self.server: StoreServer = store
        self.clients = 0
        self._apply(faults, reseed=True)

    def join(self) -> None:
        with self._lock:
            self.clients += 1

    def leave(self) -> None:
        with self._lock:
            self.clients -= 1
            last = self.clients == 0
        disconnect = getattr(self.store, "disconnect", None)  # an in-process store holds no connection
        if last and disconnect is not None:
            disconnect()

    def configure(self, **changes: Any) -> FaultSettings:
        """Change fields of ``faults`` (TypeError for an unknown one,
        TypeError or ValueError for a bad value: then nothing changes);
        setting ``seed`` restarts the draws. Returns the settings now."""
        if not changes:
            return self.faults
        with self._lock:
            settings = dataclasses.replace(self.faults, **changes)
            self._apply(settings, reseed="seed" in changes)
            return settings

    def _apply(self, settings: FaultSettings, *, reseed: bool) -> None:
        self.faults = settings
        server = self.server
        if not settings.injects:
            self.server = self.store
        elif isinstance(server, FaultyServer):
            server.retune(settings, reseed=reseed)
        else:
            self.server = FaultyServer(self.store, settings)
