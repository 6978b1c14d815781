"""``sglang-simm store``: start, status, clear, stop."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import uuid

import pytest

pytest.importorskip("rich")

from sglang_simm.tools.cli import main  # noqa: E402
from sglang_simm.local_store._handle import StoreHandle, pid_alive  # noqa: E402
from sglang_simm.local_store._paths import StorePaths  # noqa: E402

pytestmark = pytest.mark.host


def store(capsys, *args):
    code = main(["store", *args])
    return code, capsys.readouterr().out


@pytest.fixture
def name():
    return f"cli-{uuid.uuid4().hex[:8]}"


def test_status_of_nothing_starts_nothing(capsys, host_store_dir, name):
    code, out = store(capsys, "status", name, "--dir", host_store_dir)
    assert code == 1 and "not running" in out
    assert not os.path.exists(StorePaths(host_store_dir, name).socket)


def test_stop_and_clear_of_an_unknown_store_say_so_and_fail(capsys, host_store_dir, name):
    root = os.path.join(host_store_dir, f"unknown-{uuid.uuid4().hex[:6]}")
    code, out = store(capsys, "stop", name, "--dir", root)
    assert code == 1 and f"no store named {name!r}" in " ".join(out.split())
    code, out = store(capsys, "clear", name, "--dir", root)
    flat = " ".join(out.split())
    assert code == 1 and "is not running" in flat and "nothing to clear" in flat
    assert "-2301" not in flat and "BuildConnectionFailed" not in flat  # no transport code to decode
    assert not os.path.exists(StorePaths(root, name).socket)  # neither started one


def test_start_status_clear_stop(capsys, host_store_dir, name):
    code, out = store(capsys, "start", name, "--capacity", "64MiB", "--eviction", "lru", "--dir", host_store_dir)
    assert code == 0 and "64.0 MiB" in out and "lru" in out
    client = StoreHandle(name, root=host_store_dir, capacity=1 << 20, spawn=False)
    client.open()
    buf = ctypes.create_string_buffer(4096)
    assert client.put_from([("a", ctypes.addressof(buf), 4096), ("b", ctypes.addressof(buf), 4096)], True) == [0, 0]
    assert client.get_into([("a", ctypes.addressof(buf), 4096), ("zz", ctypes.addressof(buf), 4096)])[0] == 4096

    code, out = store(capsys, "status", name, "--dir", host_store_dir, "--json")
    (status,) = json.loads(out)
    assert code == 0 and status["running"]
    assert (status["capacity_bytes"], status["policy"], status["objects"]) == (64 << 20, "lru", 2)
    assert (status["hits"], status["misses"]) == (1, 1)
    assert status["clients"] == [os.getpid()]  # the asking connection is not counted

    code, out = store(capsys, "status", name, "--dir", host_store_dir)  # one store in full, as text
    assert code == 0 and f"store {name!r}" in out and "2 objects" in out and "50% hit rate" in out
    code, out = store(capsys, "status", "--dir", host_store_dir)  # every store, a line each
    (line,) = [ln for ln in out.splitlines() if name in ln]
    assert "64.0 MiB" in line and " 2 " in line and "50%" in line

    code, out = store(capsys, "start", name, "--capacity", "128MiB", "--dir", host_store_dir)
    assert code == 1 and "already running" in out and "store stop" in out

    code, out = store(capsys, "clear", name, "--dir", host_store_dir)
    assert code == 0 and "removed 2 objects" in out
    assert client.lookup(["a", "b"]) == [-4003, -4003]

    pid = client.pid
    client.close()
    code, out = store(capsys, "stop", name, "--dir", host_store_dir)
    assert code == 0 and "stopped" in out and not pid_alive(pid)


def test_stop_all(capsys, host_store_dir):
    root = os.path.join(host_store_dir, f"all-{uuid.uuid4().hex[:6]}")
    pids = []
    for n in ("one", "two"):
        s = StoreHandle(n, root=root, capacity=1 << 20)
        s.open()
        pids.append(s.pid)
        s.close()
    # without a terminal to ask on, --all wants --yes: it stops what other servers may be using
    code, out = store(capsys, "stop", "--all", "--dir", root)
    assert code == 2 and "--yes" in out and "'one'" in out and "'two'" in out
    assert all(pid_alive(p) for p in pids)
    code, out = store(capsys, "stop", "--all", "--yes", "--dir", root)
    assert code == 0 and out.count("stopped") == 2
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("columns", [None, "80"], ids=["no-COLUMNS", "COLUMNS-80"])
def test_the_list_keeps_every_value_whole_when_piped(capsys, host_store_dir, monkeypatch, columns):
    # CI's failure: output to a pipe got rich's 80 columns, and a long store name
    # beside ours cut our row's capacity to "64.0 M…". pytest-xdist's workers
    # set COLUMNS=80.
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    root = os.path.join(host_store_dir, f"wide-{uuid.uuid4().hex[:6]}")
    stores = [StoreHandle(n, root=root, capacity=64 << 20) for n in ("short", "a-store-name-as-long-as-operators-write-them")]
    for s in stores:
        s.open()
    try:
        code, out = store(capsys, "status", "--dir", root)
        assert code == 0
        for s in stores:
            (line,) = [ln for ln in out.splitlines() if s.name in ln]
            assert f"pid {s.pid}" in line and "64.0 MiB" in line and "…" not in line, out
    finally:
        for s in stores:
            s.stop()


def test_status_lists_every_store_a_line_each(capsys, host_store_dir):
    root = os.path.join(host_store_dir, f"many-{uuid.uuid4().hex[:6]}")
    stores = [StoreHandle(n, root=root, capacity=1 << 20) for n in ("live1", "live2", "killed")]
    for s in stores:
        s.open()
    try:
        os.kill(stores[2].pid, signal.SIGKILL)  # its memory stays held: a dead store
        stores[2].close()
        code, out = store(capsys, "status", "--dir", root)
        lines = {n: [ln for ln in out.splitlines() if n in ln] for n in ("live1", "live2", "killed")}
        assert all(len(found) == 1 for found in lines.values()), out
        assert "pid" in lines["live1"][0] and "1.0 MiB" in lines["live1"][0]
        assert "dead, holds" in lines["killed"][0]
        assert code == 1  # not every store runs
        code, out = store(capsys, "stop", "killed", "--dir", root)
        assert code == 0 and "freed" in out
    finally:
        for s in stores[:2]:
            s.stop()
