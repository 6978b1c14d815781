"""Minutes of writers and readers sharing one small store that evicts all the
time, through kill -9 of clients and of the store, SIGSTOP/SIGCONT, stops,
discards and restarts, and forked children on their parents' handles: every
byte read is checked, nothing hangs, and the store serves at the end.

``SGLANG_SIMM_TORTURE_S`` sets how long (default 150 s); the counts print at
the end (``-s``), for the record."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from polling import until
from raw_peer import Peer
from sglang_simm.local_store._paths import StorePaths, pid_alive, read_pid
from sglang_simm.simm_rules import OK

pytestmark = pytest.mark.host

SECONDS = float(os.environ.get("SGLANG_SIMM_TORTURE_S", "150"))
SIZE, KEYSPACE, WORKERS = 128 << 10, 300, 4


def test_clients_and_the_store_killed_stopped_and_forked_read_no_wrong_byte(root, child, objects, capsys):
    paths = StorePaths(root, "s")
    stop = os.path.join(root, "stop-workers")
    args = dict(root=root, name="s", size=SIZE, keyspace=KEYSPACE, capacity=16 << 20, stop=stop)
    workers = [child("torture", seed=i, **args) for i in range(WORKERS)]
    for w in workers:
        w.ready()
    rng = random.Random(1)
    events = {"client kill -9": 0, "client stop/cont": 0, "store kill -9": 0, "store stop": 0,
              "store stop --discard": 0}
    stopped: list = []
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.5, 2.0))
        action = rng.choice(list(events))
        events[action] += 1
        if action == "client kill -9":
            i = rng.randrange(len(workers))
            workers[i].kill9()
            workers[i] = child("torture", seed=100 + sum(events.values()), **args)
            workers[i].ready()
        elif action == "client stop/cont":
            for w in stopped:
                w.signal(signal.SIGCONT)
            stopped = [rng.choice(workers)]
            stopped[0].signal(signal.SIGSTOP)
        elif action == "store kill -9":
            pid = read_pid(paths)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        else:
            try:
                with Peer(paths, data=False, timeout=5) as admin:
                    admin.admin("stop", discard=action.endswith("--discard"))
            except (OSError, AssertionError):
                pass  # between stores: the next action finds the one the clients start
    for w in stopped:
        w.signal(signal.SIGCONT)
    open(stop, "w").close()
    results = [w.result() for w in workers]
    totals = {k: sum(r[k] for r in results) for k in results[0] if k != "problems"}
    with capsys.disabled():
        print(f"\ntorture, {SECONDS:g} s: events {json.dumps(events)}; clients {json.dumps(totals)}")
    assert [p for r in results for p in r["problems"]] == [] and totals["wrong"] == totals["fork_wrong"] == 0
    assert totals["hits"] > 100 and totals["forks"] > 0
    me = objects(size=SIZE)
    until(lambda: me._call(me.handle.lookup, ["x"]) is not None, what="the store serving at the end")
    assert me.put(["after"]) == [OK]
    got, wrong = me.read(["after"])
    assert got == [SIZE] and wrong == []
    me.handle.stop(discard=True)
