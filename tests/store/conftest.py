"""The store tests' fixtures: a directory of the test's own, store processes
and client processes started there and stopped (by pid) after the test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Any

import pytest

from checked_objects import Objects
from raw_peer import StoreProc, env
from sglang_simm.local_store._paths import stop_store_processes

CHILD = os.path.join(os.path.dirname(__file__), "store_child.py")


@pytest.fixture
def root(host_store_dir):
    """A store directory of the test's own (inside the session's); whatever
    store process a test, a client or the CLI left in it is stopped after."""
    path = tempfile.mkdtemp(prefix="t", dir=host_store_dir)
    yield path
    stop_store_processes(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(root):
    """``store(name="s", **options)`` -> a ``StoreProc`` in ``root``; every one
    started is stopped after the test."""
    made: list[StoreProc] = []

    def start(name: str = "s", **options: Any) -> StoreProc:
        proc = StoreProc(root, name, **options)
        made.append(proc)
        return proc

    yield start
    for proc in made:
        proc.stop()


class Child:
    """A client process (``store_child.py``): announces ``ready``, then prints
    one JSON line per result."""

    def __init__(self, mode: str, args: dict[str, Any]) -> None:
        self.go = os.path.join(tempfile.gettempdir(), f"go-{uuid.uuid4().hex}")
        self.go2 = self.go + "-2"
        self.proc = subprocess.Popen([sys.executable, CHILD, mode, json.dumps({"go": self.go, "go2": self.go2,
                                                                                 **args})],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        self.pid = self.proc.pid

    def ready(self) -> None:
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"the client did not get ready: {line!r} {self.proc.stderr.read()}")

    def release(self, second: bool = False) -> None:
        open(self.go2 if second else self.go, "w").close()

    def result(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the client printed nothing: {self.proc.stderr.read()}")
        return json.loads(line)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        for path in (self.go, self.go2):
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
def child():
    """``child(mode, **args)`` -> a client process; killed after the test."""
    made: list[Child] = []

    def start(mode: str, **args: Any) -> Child:
        made.append(Child(mode, args))
        return made[-1]

    yield start
    for c in made:
        c.finish()


@pytest.fixture
def objects(root):
    """``objects(name, size)`` -> an ``Objects`` client of the store ``name`` in ``root``."""
    made: list[Objects] = []

    def make(name: str = "s", size: int = 64 << 10, *, aligned: bool = False) -> Objects:
        made.append(Objects(root, name, size, aligned=aligned))
        return made[-1]

    yield make
    for o in made:
        o.close()
