"""The local store heals under the breaker: a backend on a store process
(``local://NAME``) whose process is killed or stopped.

* kill -9: calls fault (SendRPCFailed / BuildConnectionFailed) and open the
  breaker; a probe finds no store process and starts the next one, which
  takes every published object over; a later probe reaches it, closes the
  breaker, and the pages written before the kill read back byte for byte.
* SIGSTOP: calls reach the stopped store (and wait out the request time
  limit) only until the breaker opens; from then on only its probes do,
  the other calls answer without touching the client. Resumed, a probe
  closes the breaker, the same store process serves, and the pages read
  back.

Afterwards no data-path call is counted in on the host pool and the store
holds no grant of ours, open or orphaned. Real SGLang host pools, as
tests/test_backend.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pages import fill_random, hashes, page, slots, tiny
from sglang_simm.breaker import CLOSED, OPEN
from sglang_simm.local_store import get_server
from sglang_simm.local_store._paths import pid_alive
from polling import until

#: the store's answers get 0.3 s (the store's own tests use the same)
TIMEOUT_MS = 300
BREAKER = {"breaker_threshold": 2, "breaker_backoff_ms": 100, "breaker_backoff_max_ms": 400, "breaker_jitter": 0}


def counted_client(backend) -> list[str]:
    """Wrap the client's lookup and read to count the calls that reach it."""
    touched: list[str] = []
    for name in ("mexists_codes", "mget_views"):
        real = getattr(backend.client, name)

        def counted(*args, _real=real, _name=name):
            touched.append(_name)
            return _real(*args)

        setattr(backend.client, name, counted)
    return touched


def store_story(backend, store_name):
    """The breaker's state and the store process's log, for a failure message."""
    server = get_server(store_name)
    try:
        with open(server.paths.log, encoding="utf-8", errors="replace") as f:
            log = "".join(f.readlines()[-15:])
    except OSError as exc:
        log = f"(no store log: {exc})"
    return f"\nbreaker: {backend.stats()['breaker']}\nstore log {server.paths.log}:\n{log}"


@pytest.fixture
def on_store(attach, store_name):
    """(backend, host pool, store pid, want): a backend on a store process
    of the test's own holding four written pages (``want``: their bytes)."""
    backend, host = attach(tiny(), extra={"request_timeout_ms": TIMEOUT_MS, **BREAKER})
    fill_random(host, 1)
    keys = hashes(4)
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    want = [page(host, p) for p in range(4)]
    pid = get_server(store_name).pid
    assert pid_alive(pid)
    return backend, host, keys, want, pid


def assert_healed(backend, host, keys, want, store_name):
    """The pages read back byte for byte, the breaker closed, nothing held."""
    fill_random(host, 2)
    assert backend.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    assert all(torch.equal(page(host, 8 + i), want[i]) for i in range(4))
    snap = backend.stats()["breaker"]
    assert snap["state"] == CLOSED and snap["opened_total"] >= 1 and snap["closed_total"] >= 1, snap
    assert sum(len(b.calls) for _, b in backend.pools.bound()) == 0  # no call counted in on a pool
    until(lambda: (lambda s: s["open_grants"] == 0 and s["orphaned_grants"] == 0)(get_server(store_name).status()),
          "our grants to end", timeout=10)


def test_a_killed_store_is_started_again_by_a_probe_and_its_pages_come_back(on_store, store_name):
    backend, host, keys, want, pid = on_store
    os.kill(pid, signal.SIGKILL)
    until(lambda: not pid_alive(pid), "the store process to die", timeout=10)
    for _ in range(BREAKER["breaker_threshold"]):
        assert backend.batch_exists(keys) == 0
    snap = backend.stats()["breaker"]
    assert snap["state"] == OPEN, snap

    touched = counted_client(backend)
    assert backend.batch_exists(keys) == 0 and touched == []  # open: the client is not asked
    # Probes every 0.1-0.4 s: the first finds no store and starts one; a later
    # one reaches it (its start is seconds on a loaded machine).
    until(lambda: backend.batch_exists(keys) == 4, "a probe to find the pages again", timeout=60, every=0.05,
          why=lambda: store_story(backend, store_name))
    status = get_server(store_name).status()
    assert status["pid"] != pid and pid_alive(status["pid"])
    assert status["recovered"] >= 4  # the killed store's objects, served from its segment
    assert backend.stats()["breaker"]["probes"] >= 1
    assert_healed(backend, host, keys, want, store_name)


def test_a_stopped_store_costs_one_time_limit_per_probe_and_heals_when_resumed(on_store, store_name):
    backend, host, keys, want, pid = on_store
    touched = counted_client(backend)
    calls = []
    os.kill(pid, signal.SIGSTOP)
    try:
        # calls until the breaker has probed the stopped store twice: the
        # first two wait out the time limit and open the breaker, the later
        # ones are refused without touching the client, but for the probes
        def probed_twice() -> bool:
            i = len(calls)
            got = backend.batch_get_v1(keys, slots(host, 8, 4)) if i % 2 else backend.batch_exists(keys)
            calls.append(got)
            assert got in (0, [False] * 4)
            return backend.stats()["breaker"]["probes"] >= 2

        until(probed_twice, "two probes of the stopped store", timeout=60, every=0.05,
              why=lambda: store_story(backend, store_name))
        snap = backend.stats()["breaker"]
        assert snap["state"] != CLOSED and snap["opened_total"] == 1, snap
        # only the calls before the opening and the probes reached the store
        assert len(touched) <= BREAKER["breaker_threshold"] + snap["probes"], (touched, snap)
        assert snap["refused"] >= len(calls) - len(touched) and snap["refused"] >= 1, (len(calls), snap)
    finally:
        os.kill(pid, signal.SIGCONT)
    until(lambda: backend.batch_exists(keys) == 4, "a probe to reach the resumed store", timeout=30, every=0.05,
          why=lambda: store_story(backend, store_name))
    assert get_server(store_name).pid == pid  # the same process: nothing was started beside it
    assert_healed(backend, host, keys, want, store_name)
