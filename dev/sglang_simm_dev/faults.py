"""A faulty network in front of the local store: a test instrument, not in the wheel.

``configure_faults(name, **changes)`` sets, for every client of the local
store ``name`` in this process, an outage (``down``), added latency
(``latency_us``), per-entry failures (``error_rate`` of the entries fail with
``error_code``), or corrupt reads (``corrupt_rate`` of the successful reads
have their bytes flipped afterwards, still reported as hits, as a bad NIC
or DIMM would: tests use it to check that wrong bytes show downstream).
The store itself never sees any of it.

It works by wrapping the data calls of ``StoreHandle`` (the one route every
``kv.Store`` takes) once, on first use; a store with no fault set reaches
the real call at once. In an SGLang server started by the test harness,
``SGLANG_SIMM_FAULTS`` (JSON: store name, or ``"*"``, -> settings) in its
environment configures the same from its ``sitecustomize`` (``install_from_env``).

Injected codes stand for transport failures: SendRPCFailed (-2300) by
default, which the client passes through on every path, as SiMM's passes a
lost or timed-out request; an outage fails whole batches with
``StoreUnreachable``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from sglang_simm.simm_rules import SEND_RPC_FAILED, code_name

ENV = "SGLANG_SIMM_FAULTS"


@dataclass(frozen=True)
class FaultSettings:
    """The simulated network to one store; the defaults inject nothing."""

    error_rate: float = 0.0
    error_code: int = SEND_RPC_FAILED
    latency_us: float = 0.0
    down: bool = False
    corrupt_rate: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("error_rate", "corrupt_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within 0..1, got {value!r}")
        if isinstance(self.error_code, bool) or not isinstance(self.error_code, int):
            raise TypeError(f"error_code must be an int, got {self.error_code!r}")
        if not -32768 <= self.error_code <= -1:
            raise ValueError(f"error_code must be a negative int16, got {self.error_code!r}")
        if isinstance(self.latency_us, bool) or not isinstance(self.latency_us, (int, float)) \
                or not self.latency_us >= 0:
            raise ValueError(f"latency_us must be a number >= 0, got {self.latency_us!r}")
        if not isinstance(self.down, bool):
            raise TypeError(f"down must be a bool, got {self.down!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def injects(self) -> bool:
        return self.down or self.error_rate > 0 or self.latency_us > 0 or self.corrupt_rate > 0

    def describe(self) -> str:
        parts = ["down"] if self.down else []
        if self.error_rate:
            parts.append(f"error_rate={self.error_rate:g} error_code={code_name(self.error_code)}")
        parts += [f"{k}={getattr(self, k):g}" for k in ("latency_us", "corrupt_rate") if getattr(self, k)]
        return " ".join(parts) or "none"


class _Faults:
    """One store's faults, draws and counters."""

    def __init__(self, settings: FaultSettings) -> None:
        self.settings, self.injected, self.corrupted = settings, 0, 0
        self.lock = threading.Lock()
        self.rng = random.Random(settings.seed)

    def connect(self, entries: int, name: str) -> None:
        from sglang_simm.local_store.contract import StoreUnreachable

        if self.settings.down:
            with self.lock:
                self.injected += entries
            raise StoreUnreachable(SEND_RPC_FAILED, f"local store {name!r} is down (injected)")
        if self.settings.latency_us:
            time.sleep(self.settings.latency_us / 1e6)

    def draw(self, entries: int) -> list[int] | None:
        rate = self.settings.error_rate
        if rate <= 0 or not entries:
            return None
        with self.lock:
            codes = [self.settings.error_code if self.rng.random() < rate else 0 for _ in range(entries)]
            failed = entries - codes.count(0)
            self.injected += failed
        return codes if failed else None


_STORES: dict[str, _Faults] = {}
_lock = threading.Lock()
_installed = False


def configure_faults(name: str, **changes: Any) -> FaultSettings:
    """Change the network between this process and local store ``name``
    (``"*"``: every store without its own); the settings now."""
    install()
    with _lock:
        faults = _STORES.get(name)
        settings = dataclasses.replace(faults.settings if faults else FaultSettings(), **changes)
        if faults is None or "seed" in changes:
            _STORES[name] = faults = _Faults(settings)
        faults.settings = settings
        return settings


def injected(name: str) -> int:
    """Entries failed for store ``name`` so far."""
    faults = _STORES.get(name)
    return faults.injected if faults is not None else 0


def _faults_for(handle: Any) -> _Faults | None:
    faults = _STORES.get(handle.name) or _STORES.get("*")
    return faults if faults is not None and faults.settings.injects else None


def _through(real: Any, count: Any) -> Any:
    """``real`` (a data call of ``StoreHandle``: its first argument the
    entries, or one key) behind the faults of its store. Called as the
    handle's own method is, keywords included."""
    signature = inspect.signature(real)
    entries = list(signature.parameters)[1]  # after self: keys, items or key

    @functools.wraps(real)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        faults = _faults_for(self)
        if faults is None:
            return real(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        items = bound.arguments[entries]
        single = isinstance(items, str)
        batch = [items] if single else list(items)
        faults.connect(len(batch), self.name)
        codes = faults.draw(len(batch))
        if codes is None:
            out = real(*bound.args, **bound.kwargs)
        else:
            passed = [item for item, code in zip(batch, codes) if not code]
            answers: Any = iter(())
            if passed:
                bound.arguments[entries] = passed[0] if single else passed
                answers = iter(real(*bound.args, **bound.kwargs))
            out = [code or next(answers) for code in codes]
            out = out[0] if single else out
        count(faults, batch, out)
        return out

    return call


def _corrupt(faults: _Faults, items: list, codes: Any) -> None:
    from sglang_simm.local_store._copy import memory

    rate = faults.settings.corrupt_rate
    reads = [(item[1], code) for item, code in zip(items, codes) if code > 0]
    if rate <= 0 or not reads:
        return
    with faults.lock:
        chosen = [read for read in reads if faults.rng.random() < rate]
        faults.corrupted += len(chosen)
    for ptr, size in chosen:  # the top bit of every byte: every float value is still finite, and wrong
        view = memory(ptr, size)
        view[:] = bytes(b ^ 0x80 for b in view)


def install() -> None:
    """Wrap ``StoreHandle``'s data calls (once): a store with a fault set
    goes through the faults, any other straight to its store."""
    global _installed
    with _lock:
        if _installed:
            return
        from sglang_simm.local_store._handle import StoreHandle

        StoreHandle.put_from = _through(StoreHandle.put_from, lambda *a: None)
        StoreHandle.get_into = _through(StoreHandle.get_into, _corrupt)
        StoreHandle.lookup = _through(StoreHandle.lookup, lambda *a: None)
        StoreHandle.delete = _through(StoreHandle.delete, lambda *a: None)
        from sglang_simm.local_store import _kv

        real_handle_for = _kv._handle_for

        def handle_for(name: str) -> Any:  # a store that is down cannot be joined either
            faults = _STORES.get(name) or _STORES.get("*")
            if faults is not None and faults.settings.down:
                faults.connect(1, name)
            return real_handle_for(name)

        _kv._handle_for = handle_for
        _installed = True


def install_from_env(environ: Any = None) -> None:
    """``SGLANG_SIMM_FAULTS`` (JSON: store name or "*" -> FaultSettings fields), if set.
    Settings that do not parse or validate raise ``ValueError`` naming the
    variable, before any store's faults change."""
    text = (environ if environ is not None else os.environ).get(ENV)
    if not text:
        return
    try:
        stores = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV} is not JSON ({exc}): {text!r}") from exc
    if not isinstance(stores, dict) or not all(isinstance(fields, dict) for fields in stores.values()):
        raise ValueError(f'{ENV} must map store names (or "*") to settings, as {{"NAME": {{"down": true}}}}, '
                         f"got {text!r}")
    for name, fields in stores.items():
        try:
            FaultSettings(**fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{ENV}: store {name!r}: {exc}") from exc
    for name, fields in stores.items():
        configure_faults(name, **fields)
