"""``private_store_dir``: the store directory of one run (a benchmark, the
demo, this test session), with every store process started in it stopped
and every file it held removed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from sglang_simm.local_store._handle import StoreHandle, pid_alive
from sglang_simm.local_store._paths import STORE_DIR_ENV, StorePaths, private_store_dir, stop_store_processes

pytestmark = pytest.mark.host


def test_a_store_started_inside_is_stopped_and_its_files_removed_at_the_end(host_store_dir):
    name = f"pd-{uuid.uuid4().hex[:8]}"
    with private_store_dir("sglang-simm-pd-") as root:
        assert os.environ[STORE_DIR_ENV] == root
        assert os.path.dirname(root) == host_store_dir  # under the directory stores would use
        assert os.stat(root).st_mode & 0o777 == 0o700
        server = StoreHandle(name, capacity=16 << 20)  # its directory from the environment, as a server's is
        server.open()
        pid = server.pid
        assert pid_alive(pid) and os.path.exists(StorePaths(root, name).lock)
        # the client is not closed: the store must still go
    assert not pid_alive(pid)
    assert not os.path.exists(root)
    assert os.environ[STORE_DIR_ENV] == host_store_dir  # put back as it was


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
