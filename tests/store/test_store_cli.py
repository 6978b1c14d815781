"""``sglang-simm store``: start, status, clear, stop; what each says.

A stop keeps the objects for the next start (``--discard`` drops them), and
``status`` shows a stopped store and what its files keep."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import uuid

import pytest

pytest.importorskip("rich")

from polling import until  # noqa: E402
from sglang_simm.local_store._handle import StoreHandle, pid_alive  # noqa: E402
from sglang_simm.local_store._paths import StorePaths  # noqa: E402
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK  # noqa: E402
from sglang_simm.tools.cli import main  # noqa: E402

pytestmark = pytest.mark.host


def store(capsys, *args):
    code = main(["store", *args])
    return code, " ".join(capsys.readouterr().out.split())  # rich wraps long lines: compare words


def lines(capsys, *args):
    code = main(["store", *args])
    return code, capsys.readouterr().out.splitlines()


@pytest.fixture
def name():
    return f"cli-{uuid.uuid4().hex[:8]}"


def client_of(root: str, name: str) -> StoreHandle:
    client = StoreHandle(name, root=root, capacity=1 << 20, spawn=False, timeout_s=5)
    client.open()
    return client


def put(client: StoreHandle, *keys: str) -> list[int]:
    buf = ctypes.create_string_buffer(4096)
    return client.put_from([(k, ctypes.addressof(buf), 4096) for k in keys], True)


def gone(pid: int) -> None:
    until(lambda: not pid_alive(pid), what=f"store process {pid} to exit")


def test_status_of_nothing_starts_nothing(capsys, root, name):
    code, out = store(capsys, "status", name, "--dir", root)
    assert code == 1 and "not running" in out and "files keep" not in out
    assert not os.path.exists(StorePaths(root, name).socket)


def test_stop_and_clear_of_an_unknown_store_say_so_and_fail(capsys, root, name):
    elsewhere = os.path.join(root, "unknown")
    code, out = store(capsys, "stop", name, "--dir", elsewhere)
    assert code == 1 and f"no store named {name!r}" in out
    code, out = store(capsys, "clear", name, "--dir", elsewhere)
    assert code == 1 and "is not running" in out and "nothing to clear" in out
    assert "-2301" not in out and "BuildConnectionFailed" not in out  # no transport code to decode
    assert not os.path.exists(StorePaths(elsewhere, name).socket)  # neither started one


def test_start_status_clear_stop(capsys, root, name):
    code, out = store(capsys, "start", name, "--capacity", "64MiB", "--eviction", "lru", "--dir", root)
    assert code == 0 and "64.0 MiB" in out and "lru" in out and "running" in out
    client = client_of(root, name)
    assert put(client, "a", "b") == [OK, OK]
    buf = ctypes.create_string_buffer(4096)
    assert client.get_into([("a", ctypes.addressof(buf), 4096), ("zz", ctypes.addressof(buf), 4096)]) == \
        [4096, DS_KEY_NOT_FOUND]

    code, out = store(capsys, "status", name, "--dir", root, "--json")
    (status,) = json.loads(out)
    assert code == 0 and status["running"]
    assert (status["capacity_bytes"], status["policy"], status["objects"]) == (64 << 20, "lru", 2)
    assert (status["hits"], status["misses"]) == (1, 1)
    assert status["clients"] == [os.getpid()]  # the asking connection is not counted
    assert status["files_bytes"] > 0

    code, out = store(capsys, "status", name, "--dir", root)  # one store in full, as text
    assert code == 0 and f"store {name!r}" in out and "in 2 objects" in out
    assert "1 hits, 1 misses (50%)" in out and "lru eviction" in out
    code, rows = lines(capsys, "status", "--dir", root)  # every store, a line each
    (line,) = [ln for ln in rows if name in ln]
    assert "64.0 MiB" in line and " 2 " in line and "50%" in line

    code, out = store(capsys, "start", name, "--capacity", "128MiB", "--dir", root)
    assert code == 1 and "already running" in out and f"store stop {name}" in out and "objects are kept" in out
    code, out = store(capsys, "start", name, "--capacity", "64MiB", "--eviction", "lru", "--dir", root)
    assert code == 0 and "already running" in out  # as asked: nothing to do

    code, out = store(capsys, "clear", name, "--dir", root)
    assert code == 0 and "removed 2 objects" in out
    assert client.lookup(["a", "b"]) == [DS_KEY_NOT_FOUND, DS_KEY_NOT_FOUND]

    pid = client.pid
    client.close()
    code, out = store(capsys, "stop", name, "--dir", root)
    assert code == 0 and f"(pid {pid}) stopped" in out and "for its next start" in out and "--discard" in out
    gone(pid)


def test_a_stop_keeps_the_objects_and_status_says_what_the_files_keep(capsys, root, name):
    code, _ = store(capsys, "start", name, "--capacity", "64MiB", "--dir", root)
    assert code == 0
    client = client_of(root, name)
    assert put(client, "kept-1", "kept-2") == [OK, OK]
    pid = client.pid
    client.close()
    code, out = store(capsys, "stop", name, "--dir", root)
    assert code == 0 and "its files keep" in out and "for its next start" in out
    gone(pid)

    code, out = store(capsys, "status", name, "--dir", root)
    assert code == 1 and "not running" in out and "its files keep" in out
    assert f"'sglang-simm store start {name}' serves them" in out and f"store stop --discard {name}' frees" in out
    code, rows = lines(capsys, "status", "--dir", root)
    (line,) = [ln for ln in rows if name in ln]
    assert code == 1 and "stopped, keeps" in line
    code, out = store(capsys, "status", name, "--dir", root, "--json")
    (status,) = json.loads(out)
    assert not status["running"] and status["kept"] and status["files_bytes"] > 0
    code, out = store(capsys, "stop", name, "--dir", root)  # stopped already: it says what is kept
    assert code == 0 and "is not running" in out and "its files keep" in out

    code, out = store(capsys, "start", name, "--capacity", "64MiB", "--dir", root)
    assert code == 0 and "it serves 2 objects kept from its last run" in out
    client = client_of(root, name)
    assert client.lookup(["kept-1", "kept-2"]) == [OK, OK]
    pid = client.pid
    client.close()

    code, out = store(capsys, "stop", name, "--discard", "--dir", root)
    assert code == 0 and "its objects are discarded" in out
    gone(pid)
    code, out = store(capsys, "status", name, "--dir", root, "--json")
    (status,) = json.loads(out)
    assert not status["running"] and not status["kept"] and status["files_bytes"] == 0
    code, out = store(capsys, "start", name, "--capacity", "64MiB", "--dir", root)
    assert code == 0 and "kept from its last run" not in out
    client = client_of(root, name)
    assert client.lookup(["kept-1"]) == [DS_KEY_NOT_FOUND]
    client.stop(discard=True)


def test_discarding_a_stopped_store_frees_what_its_files_hold(capsys, root, name):
    code, _ = store(capsys, "start", name, "--capacity", "64MiB", "--dir", root)
    client = client_of(root, name)
    assert put(client, "x") == [OK]
    pid = client.pid
    client.close()
    os.kill(pid, signal.SIGKILL)  # its files stay, as after a stop
    gone(pid)
    code, out = store(capsys, "stop", name, "--discard", "--dir", root)
    assert code == 0 and "is not running: freed the" in out and "its files held" in out
    assert StorePaths(root, name).segments() == {}


@pytest.mark.parametrize("capacity", ["1MiB", str((64 << 20) - 1), "63MiB"])
def test_a_capacity_below_the_smallest_store_is_refused_naming_the_floor(capsys, root, name, capacity):
    code, out = store(capsys, "start", name, "--capacity", capacity, "--dir", root)
    assert code == 2 and "below the smallest store, 64.0 MiB" in out and "64MiB or more" in out
    assert not os.path.exists(StorePaths(root, name).socket)


@pytest.mark.parametrize("capacity", ["--capacity=-5GiB", "--capacity=-1"])
def test_a_negative_capacity_is_refused_saying_so(capsys, root, name, capacity):
    code, out = store(capsys, "start", name, capacity, "--dir", root)
    assert code == 2 and "must be a positive size" in out and capacity.partition("=")[2] in out
    assert not os.path.exists(StorePaths(root, name).socket)


def test_stop_all(capsys, root):
    pids = []
    for n in ("one", "two"):
        s = StoreHandle(n, root=root, capacity=64 << 20)
        s.open()
        pids.append(s.pid)
        s.close()
    # without a terminal to ask on, --all wants --yes: it stops what other servers may be using
    code, out = store(capsys, "stop", "--all", "--dir", root)
    assert code == 2 and "--yes" in out and "'one'" in out and "'two'" in out
    assert all(pid_alive(p) for p in pids)
    code, out = store(capsys, "stop", "--all", "--yes", "--dir", root)
    assert code == 0 and out.count("stopped in") == 2
    for pid in pids:
        gone(pid)


@pytest.mark.parametrize("columns", [None, "80"], ids=["no-COLUMNS", "COLUMNS-80"])
def test_the_list_keeps_every_value_whole_when_piped(capsys, root, monkeypatch, columns):
    # output to a pipe got rich's 80 columns, and a long store name beside
    # ours cut our row's capacity to "64.0 M…" (pytest-xdist's workers set COLUMNS=80)
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    stores = [StoreHandle(n, root=root, capacity=64 << 20)
              for n in ("short", "a-store-name-as-long-as-operators-write-them")]
    for s in stores:
        s.open()
    try:
        code, rows = lines(capsys, "status", "--dir", root)
        assert code == 0
        for s in stores:
            (line,) = [ln for ln in rows if s.name in ln]
            assert f"pid {s.pid}" in line and "64.0 MiB" in line and "…" not in line, rows
    finally:
        for s in stores:
            s.stop(discard=True)


def test_status_lists_every_store_a_line_each(capsys, root):
    stores = [StoreHandle(n, root=root, capacity=64 << 20) for n in ("live1", "live2", "killed")]
    for s in stores:
        s.open()
    try:
        killed = stores[2].pid
        os.kill(killed, signal.SIGKILL)  # its files stay: a stopped store that keeps them
        gone(killed)
        stores[2].close()
        code, rows = lines(capsys, "status", "--dir", root)
        found = {n: [ln for ln in rows if n in ln] for n in ("live1", "live2", "killed")}
        assert all(len(ln) == 1 for ln in found.values()), rows
        assert "pid" in found["live1"][0] and "64.0 MiB" in found["live1"][0]
        assert "stopped, keeps" in found["killed"][0]
        assert code == 1  # not every store runs
    finally:
        for s in stores[:2]:
            s.stop(discard=True)


def test_status_all_lists_stopped_stores_that_hold_nothing(capsys, root, name):
    """A name whose objects were dropped and only its settings are left:
    hidden from the list, shown by ``--all``."""
    code, _ = store(capsys, "start", name, "--capacity", "64MiB", "--dir", root)
    paths = StorePaths(root, name)
    with open(paths.settings, "rb") as f:
        settings = f.read()
    code, _ = store(capsys, "stop", name, "--discard", "--dir", root)
    assert code == 0
    with open(os.open(paths.settings, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(settings)
    code, out = store(capsys, "status", "--dir", root)
    assert name not in out and "1 stopped and empty: --all lists them" in out
    code, rows = lines(capsys, "status", "--all", "--dir", root)
    (line,) = [ln for ln in rows if name in ln]
    assert "stopped" in line and "keeps" not in line
