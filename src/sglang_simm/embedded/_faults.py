"""Fault injection for the local store, kept apart from storage.

A :class:`FaultInjector` belongs to one :class:`EmbeddedServer` and plays the
part of the network between the clients and that server. The client asks it,
once per call, whether the call reaches the server at all (``down``), waits
``latency_us``, then draws per entry whether that entry fails with
``error_code``. Storage never looks at it.

``corrupt_rate`` is the one fault that is not a failure: a read that
succeeded has its destination's bytes flipped afterwards, as a bad NIC or a
bad DIMM would, and still reports success. It exists so that tests can check
that wrong bytes are visible downstream (a test that cannot fail is none).

The failures it produces stand for transport-level failures (an RPC that
timed out or could not be sent): the real client returns those codes
unchanged on every path, sync and async alike, so the embedded client does
too. The default is SendRPCFailed (-2300): at SiMM's HEAD a timed-out or
lost request surfaces as that code; the client never produces Timeout
(-1002) (``clnt_messenger.cc``, ``call_sync``).
"""

from __future__ import annotations

import random
import threading
import time

from sglang_simm.embedded.simm_rules import SEND_RPC_FAILED, code_name


class FaultInjector:
    """Error rate, added latency and an outage switch for one server.

    Deterministic when ``seed`` is set: the same sequence of calls on a fresh
    injector with the same seed fails the same entries (draws are taken in
    entry order, one per entry that reaches the network, under a lock).
    """

    __slots__ = (
        "_lock",
        "_rng",
        "_seed",
        "corrupt_rate",
        "corrupted",
        "down",
        "error_code",
        "error_rate",
        "injected",
        "latency_us",
    )

    def __init__(
        self,
        *,
        error_rate: float = 0.0,
        error_code: int = SEND_RPC_FAILED,
        latency_us: float = 0.0,
        down: bool = False,
        corrupt_rate: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._seed: int | None = None
        self._rng = random.Random()
        self.error_rate = 0.0
        #: The code an entry fails with when the error-rate draw hits it.
        self.error_code = SEND_RPC_FAILED
        #: Added to every call that reaches the network, in microseconds.
        self.latency_us = 0.0
        #: The server cannot be reached: calls fail with SendRPCFailed, ``Store()`` raises.
        self.down = False
        #: Entries failed by this injector so far (outage and error rate).
        self.injected = 0
        #: Share of successful reads whose bytes are flipped (see the module docstring).
        self.corrupt_rate = 0.0
        #: Reads corrupted so far.
        self.corrupted = 0
        self.configure(
            error_rate=error_rate,
            error_code=error_code,
            latency_us=latency_us,
            down=down,
            corrupt_rate=corrupt_rate,
            seed=seed,
        )

    # -- settings ---------------------------------------------------------

    def configure(self, **settings: object) -> None:
        """Change any of ``error_rate``, ``error_code``, ``latency_us``,
        ``down``, ``corrupt_rate``, ``seed``; each is validated, and a bad one
        changes nothing. Setting ``seed`` (an int, or None for unseeded)
        restarts the draws."""
        unknown = set(settings) - {"error_rate", "error_code", "latency_us", "down", "corrupt_rate", "seed"}
        if unknown:
            raise TypeError(f"unknown fault setting(s): {', '.join(sorted(map(repr, unknown)))}")
        new = {}
        if "error_rate" in settings:
            new["error_rate"] = _check_rate(settings["error_rate"], "error_rate")
        if "corrupt_rate" in settings:
            new["corrupt_rate"] = _check_rate(settings["corrupt_rate"], "corrupt_rate")
        if "error_code" in settings:
            new["error_code"] = _check_code(settings["error_code"])
        if "latency_us" in settings:
            new["latency_us"] = _check_latency(settings["latency_us"])
        if "down" in settings:
            if not isinstance(settings["down"], bool):
                raise TypeError(f"down must be a bool, got {settings['down']!r}")
            new["down"] = settings["down"]
        with self._lock:
            if "seed" in settings:
                seed = settings["seed"]
                if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                    raise TypeError(f"seed must be an int or None, got {seed!r}")
                self._seed = seed
                self._rng = random.Random(seed)
            for name, value in new.items():
                setattr(self, name, value)

    @property
    def seed(self) -> int | None:
        return self._seed

    def reset(self) -> None:
        """No faults; the seed (if any) restarts."""
        self.configure(
            error_rate=0.0, error_code=SEND_RPC_FAILED, latency_us=0.0, down=False, corrupt_rate=0.0, seed=self._seed
        )

    # -- used by the client, once per call --------------------------------

    def delay(self) -> None:
        """Sleep ``latency_us`` (``time.sleep`` releases the GIL)."""
        latency = self.latency_us
        if latency > 0:
            time.sleep(latency / 1e6)

    def outage(self, entries: int) -> bool:
        """True (and the entries counted as injected) when the server is down."""
        if not self.down:
            return False
        with self._lock:
            self.injected += entries
        return True

    def draw(self, entries: int) -> list[int] | None:
        """Per entry, 0 or ``error_code``; None when no entry fails (the common
        case, so callers can skip a pass)."""
        rate = self.error_rate
        if rate <= 0.0 or entries == 0:
            return None
        code = self.error_code
        with self._lock:
            rnd = self._rng.random
            codes = [code if rnd() < rate else 0 for _ in range(entries)]
            failed = entries - codes.count(0)
            self.injected += failed
        return codes if failed else None

    def corrupt(self, entries: int) -> list[bool] | None:
        """Per successful read, whether to flip its bytes; None when none is
        (the common case). Draws come from the same seeded sequence."""
        rate = self.corrupt_rate
        if rate <= 0.0 or entries == 0:
            return None
        with self._lock:
            rnd = self._rng.random
            chosen = [rnd() < rate for _ in range(entries)]
            hit = sum(chosen)
            self.corrupted += hit
        return chosen if hit else None

    def __repr__(self) -> str:
        parts = []
        if self.down:
            parts.append("down")
        if self.error_rate:
            parts.append(f"error_rate={self.error_rate:g} error_code={code_name(self.error_code)}")
        if self.latency_us:
            parts.append(f"latency_us={self.latency_us:g}")
        if self.corrupt_rate:
            parts.append(f"corrupt_rate={self.corrupt_rate:g}")
        if self._seed is not None:
            parts.append(f"seed={self._seed}")
        return f"<FaultInjector {' '.join(parts) or 'none'}>"


def _check_rate(value: object, name: str = "error_rate") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    rate = float(value)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{name} must be within 0..1, got {value!r}")
    return rate


def _check_code(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"error_code must be an int, got {value!r}")
    # The real client's codes are negative int16.
    if not -32768 <= value <= -1:
        raise ValueError(f"error_code must be a negative int16 (-32768..-1), got {value!r}")
    return value


def _check_latency(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"latency_us must be a number, got {value!r}")
    latency = float(value)
    if not latency >= 0.0:  # also rejects NaN
        raise ValueError(f"latency_us must be >= 0, got {value!r}")
    return latency
