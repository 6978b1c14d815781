"""A server the tests or the demo launch never outlives them, even when they
are killed outright (a CI timeout, SIGKILL): it runs in a session of its own,
so only the death signal set at launch reaches it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sglang_simm.local_store._handle import pid_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_launched_process_ends_when_its_launcher_is_killed(tmp_path, how):
    pidfile = tmp_path / "child.pid"
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from sglang_simm_dev.sglang_server import ends_with_launcher
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True, preexec_fn=ends_with_launcher())
        with open({str(pidfile) + '.tmp'!r}, "w") as f:
            f.write(str(child.pid))
        os.replace({str(pidfile) + '.tmp'!r}, {str(pidfile)!r})
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    child = None
    try:
        assert _wait(pidfile.exists, 60), "the launcher never started its child"
        child = int(pidfile.read_text())
        assert pid_alive(child) and os.getpgid(child) != os.getpgid(proc.pid)  # a session of its own
        proc.send_signal(how)
        proc.wait(timeout=30)
        assert _wait(lambda: not pid_alive(child), 10), "the child outlived its launcher"
    finally:
        proc.kill()
        proc.wait()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_launched_process_lives_while_its_launcher_does(tmp_path):
    """The death signal is armed in the child (it reads SIGTERM back from
    the kernel) and is no timer: the child runs on while its launcher does."""
    from sglang_simm_dev.sglang_server import ends_with_launcher

    probe = textwrap.dedent("""
        import ctypes, sys, time
        sig = ctypes.c_int(-1)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
        print(sig.value, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", probe], start_new_session=True,
                             preexec_fn=ends_with_launcher(), stdout=subprocess.PIPE, text=True)
    try:
        assert int(child.stdout.readline()) == signal.SIGTERM
        time.sleep(0.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_a_test_run_ended_by_sigterm_still_stops_its_store_processes():
    """SIGTERM (a CI timeout, a `kill`) ends a run like Ctrl-C: the session's
    teardown stops the store processes it started and removes their memory."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_SIMM_STORE_DIR"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", os.path.join(here, "sigterm_probe.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=os.path.dirname(here),
    )
    root = pid = None
    try:
        for line in proc.stdout:
            if line.startswith("READY "):
                _, root, pid_text = line.split()
                pid = int(pid_text)
                break
        assert pid is not None and pid_alive(pid), "the probe never opened its store"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "KeyboardInterrupt" in out
        assert _wait(lambda: not pid_alive(pid), 10), "the store process outlived the run"
        assert not os.path.exists(root), "the run's store directory is still there"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_demo_ended_by_sigterm_stops_the_store_it_started(host_store_dir):
    """`kill` of `sglang-simm-dev demo` mid-run exits through its cleanup: the
    local store it started for itself is stopped, not left behind."""
    from sglang_simm.local_store._paths import StorePaths, read_pid

    script = textwrap.dedent("""
        import sys, time
        from sglang_simm_dev import cli
        from sglang_simm_dev.demo import kv

        def waiting(self, driver, requests):  # the demo, stopped mid-run
            print("READY", flush=True)
            time.sleep(600)

        kv.Demo._run_phases = waiting
        sys.exit(cli.main(["demo", "--model", "tiny", "--pages", "4", "--direct"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "SGLANG_SIMM_STORE_DIR": host_store_dir})
    store_pid = None
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith("READY"):
                break
        # its store lives in a directory of the run's own, under the one it was given
        (root,) = glob.glob(os.path.join(host_store_dir, "sglang-simm-demo-*"))
        store_pid = read_pid(StorePaths(root, f"demo-{proc.pid}"))
        assert pid_alive(store_pid), "".join(out)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert _wait(lambda: not pid_alive(store_pid), 10), "the demo's own store outlived it"
        assert not os.path.exists(root), "the demo's store directory is still there"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if store_pid and pid_alive(store_pid):
            os.kill(store_pid, signal.SIGKILL)


@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "crashed first"])
def test_a_stopped_server_leaves_no_load_report_file_in_dev_shm(tmp_path, crash):
    """SGLang's schedulers map a load-report file in /dev/shm and leave it
    there when they end by a signal (SGLang sweeps them only in its own CI):
    ``stop`` removes what the server's processes had mapped, also after a
    ``crash`` (every process killed at once). A child of the launched
    process maps one here, as a scheduler does."""
    import uuid

    from sglang_simm_dev.sglang_server import SGLANG_SHM_PREFIX, ServerConfig, SGLangServer

    path = f"{SGLANG_SHM_PREFIX}test_{uuid.uuid4().hex[:8]}.shm"
    other = f"{SGLANG_SHM_PREFIX}test_{uuid.uuid4().hex[:8]}.shm"  # another server's: not ours to remove
    open(other, "wb").close()
    child = textwrap.dedent(f"""
        import mmap, os, subprocess, sys, time
        code = "import mmap, os, time; fd = os.open({path!r}, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 16384); " \\
               "m = mmap.mmap(fd, 16384); print('mapped', flush=True); time.sleep(600)"
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "mapped"
        print("ready", flush=True)
        time.sleep(600)
    """)
    server = SGLangServer(ServerConfig(model_path="unused"), tmp_path, name="stand-in")
    server.proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
    try:
        assert server.proc.stdout.readline().strip() == "ready"
        assert os.path.exists(path)
        if crash:
            server.crash()
            assert os.path.exists(path)  # a crash leaves it, as SGLang's do
        server.stop(timeout=5, grace=5)
        assert not os.path.exists(path) and os.path.exists(other)
    finally:
        for leftover in (path, other):
            if os.path.exists(leftover):
                os.unlink(leftover)
        if server.proc is not None:
            server.stop(timeout=5, grace=5)


def test_a_server_that_cannot_bind_its_port_fails_its_start_at_once(tmp_path):
    """SGLang's launcher keeps running when uvicorn cannot bind the port
    (it waits on its scheduler): the start fails on the log's line, naming
    the port, not after the whole start-up time limit. A stand-in launcher
    writes uvicorn's line and stays up as SGLang's does."""
    from dataclasses import dataclass

    from sglang_simm_dev.sglang_server import ServerConfig, ServerError, SGLangServer

    @dataclass(frozen=True)
    class StandIn(ServerConfig):
        def launch_args(self, port: int) -> list[str]:
            line = f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): address already in use"
            return [sys.executable, "-c", f"import time; print({line!r}, flush=True); time.sleep(600)"]

    server = SGLangServer(StandIn(model_path="unused", startup_timeout_s=120.0), tmp_path, name="taken")
    with pytest.raises(ServerError, match=r"could not bind port \d+") as exc:
        server.start()
    assert "not healthy after" not in str(exc.value)
    assert server.proc is None or server.proc.poll() is not None  # stopped, not left running


def test_a_free_port_for_a_server_lies_below_the_ephemeral_range():
    """Outside what bind(0) hands out, where the server's own children
    (gloo's listeners) could take it before the server binds it."""
    import socket

    from sglang_simm_dev.sglang_server import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    port = free_port()
    assert port < ephemeral_low
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # free
