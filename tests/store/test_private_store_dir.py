"""Private store directories: ``private_store_dir``, the store directory of
one run (a benchmark, the demo, this test session), with every store process
started in it stopped and every file it held removed at the end, the objects
a stop keeps included; and the ``process`` scope's directory, where the
inprocess store of one process lives, shared with no other."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import uuid

import pytest

from polling import until
from raw_peer import env
from sglang_simm import local_store
from sglang_simm.local_store._handle import StoreHandle, pid_alive
from sglang_simm.local_store._paths import STORE_DIR_ENV, StorePaths, private_store_dir, stop_store_processes
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK

pytestmark = pytest.mark.host


def test_a_store_started_inside_is_stopped_and_its_files_removed_at_the_end(host_store_dir):
    name = f"pd-{uuid.uuid4().hex[:8]}"
    with private_store_dir("sglang-simm-pd-") as root:
        assert os.environ[STORE_DIR_ENV] == root
        assert os.path.dirname(root) == host_store_dir  # under the directory stores would use
        assert os.stat(root).st_mode & 0o777 == 0o700
        server = StoreHandle(name, capacity=64 << 20)  # its directory from the environment, as a server's is
        server.open()
        pid = server.pid
        assert pid_alive(pid) and os.path.exists(StorePaths(root, name).lock)
        buf = ctypes.create_string_buffer(1 << 20)
        assert server.put_from([("k", ctypes.addressof(buf), 1 << 20)], True) == [OK]
        # the client is not closed: the store must still go
    assert not pid_alive(pid)
    assert not os.path.exists(root)  # the segment its stop kept with it
    assert os.environ[STORE_DIR_ENV] == host_store_dir  # put back as it was


def test_the_files_a_stopped_store_kept_are_removed_at_the_end(host_store_dir):
    name = f"pd-{uuid.uuid4().hex[:8]}"
    with private_store_dir("sglang-simm-pd-") as root:
        server = StoreHandle(name, capacity=64 << 20)
        server.open()
        buf = ctypes.create_string_buffer(1 << 20)
        assert server.put_from([("k", ctypes.addressof(buf), 1 << 20)], True) == [OK]
        assert server.stop()  # the objects are kept for the next start
        paths = StorePaths(root, name)
        assert paths.segments() and os.path.exists(paths.index)
    assert not os.path.exists(root)


def test_the_store_directory_is_put_back_when_the_run_fails(host_store_dir):
    with pytest.raises(RuntimeError, match="the run failed"):
        with private_store_dir("sglang-simm-pd-") as root:
            raise RuntimeError("the run failed")
    assert not os.path.exists(root)
    assert os.environ[STORE_DIR_ENV] == host_store_dir


def test_a_pid_file_naming_a_process_that_holds_no_store_lock_is_never_signalled(tmp_path):
    """A store that died leaves its pid file; the pid may now be anyone's."""
    root = str(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        paths = StorePaths(root, "dead")
        with open(paths.pid, "w") as f:
            f.write(str(other.pid))
        open(paths.lock, "w").close()  # the dead store's lock file, held by nobody
        assert stop_store_processes(root, wait_s=0.2) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


CHILD = """
import ctypes, json, sys
from sglang_simm import local_store as kv
name, root = sys.argv[1:3]
for flag, value in (("local_store_scope", "process"), ("local_store_dir", root), ("cm_primary_node_ip", name),
                    ("local_store_capacity_bytes", str(64 << 20))):
    assert kv.set_flag(flag, value)
server = kv.Store().server
buf = ctypes.create_string_buffer(4096)
print(json.dumps({"root": server.root, "lookup": server.lookup(["parent-key"]),
                  "put": server.put_from([("child-key", ctypes.addressof(buf), 4096)], True)}), flush=True)
"""


def test_an_inprocess_store_lives_in_a_directory_of_its_processs_own(root):
    """Two processes with a ``process``-scope store of the same name hold two
    stores, each in a private directory under the store directory, gone
    with its process."""
    name = f"pd-inprocess-{uuid.uuid4().hex[:8]}"
    for flag, value in (("local_store_scope", "process"), ("local_store_dir", root), ("cm_primary_node_ip", name),
                        ("local_store_capacity_bytes", str(64 << 20))):
        assert local_store.set_flag(flag, value)
    client = local_store.Store()
    try:
        server = client.server
        mine = server.root
        # made under the store directory of the first process-scope store of this process
        assert os.path.basename(mine).startswith(f"inprocess-{os.getpid()}-")
        assert os.stat(mine).st_mode & 0o777 == 0o700
        buf = ctypes.create_string_buffer(4096)
        assert server.put_from([("parent-key", ctypes.addressof(buf), 4096)], True) == [OK]
        done = subprocess.run([sys.executable, "-c", CHILD, name, root], env=env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        theirs = json.loads(done.stdout.splitlines()[-1])
        assert theirs["root"] != mine and os.path.dirname(theirs["root"]) == root
        assert theirs["lookup"] == [DS_KEY_NOT_FOUND] and theirs["put"] == [OK]
        assert server.lookup(["child-key", "parent-key"]) == [DS_KEY_NOT_FOUND, OK]
        until(lambda: not os.path.exists(theirs["root"]), what="the child's directory to go with it")
    finally:
        client.close()
        local_store.reset_servers(name)
