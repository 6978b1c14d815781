"""How a CPU SGLang server of the tests and the demo starts, fails and stops,
with stand-in launchers (a few lines of Python in place of
``sglang.launch_server``): a failed start names SGLang's reason, a relative
working folder works, and the server's temporary files go with it."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from sglang_simm_dev.sglang_server import ServerConfig, ServerError, SGLangServer, failure_reason

#: The end of a real server log (SGLang 0.5.23, a host pool larger than the
#: host's free memory): the scheduler's traceback, logged again by the
#: scheduler, then the launcher's own lines as it ends.
HOST_POOL_REFUSED = textwrap.dedent("""\
    [2026-12-06 14:23:33] Ignore import error when loading sglang.srt.models.midashenglm: No module named 'torchaudio'
    Traceback (most recent call last):
      File "sglang/srt/mem_cache/pool_host/base.py", line 252, in _allocate_host_buffer
        raise ValueError(
    ValueError: Not enough host memory available. Requesting 4194.30 GB but only have 5.65 GB free. Please reduce the size of the hierarchical cache.
    [2026-12-06 14:23:33] Scheduler hit an exception: Traceback (most recent call last):
      File "sglang/srt/managers/scheduler.py", line 6362, in run_scheduler_process
        scheduler = Scheduler(server_args, port_args)
    ValueError: Not enough host memory available. Requesting 4194.30 GB but only have 5.65 GB free. Please reduce the size of the hierarchical cache.

    [2026-12-06 14:23:33] Received sigquit from a child process. It usually means the child failed.
    [2026-12-06 14:23:33] kill_process_tree called: parent_pid=7872, include_parent=True, pid=7872
""")

REASON = "ValueError: Not enough host memory available. Requesting 4194.30 GB but only have 5.65 GB free."


@dataclass(frozen=True)
class StandIn(ServerConfig):
    """A launcher that runs ``code`` (``python -S``: no site, so no
    stand-ins' sitecustomize runs; ``PYTHONPATH`` still counts)."""

    code: str = ""

    def launch_args(self, port: int) -> list[str]:
        return [sys.executable, "-S", "-c", self.code]


def fails_like_sglang(log: str = HOST_POOL_REFUSED) -> str:
    return f"import sys; sys.stdout.write({log!r}); sys.exit(1)"


def logged(server: SGLangServer, tag: str, timeout: float = 30.0) -> list[str]:
    """The words after ``tag`` on the stand-in's first line that starts with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log_text().splitlines():
            if line.startswith(tag + " "):
                return line.split()[1:]
        time.sleep(0.05)
    raise AssertionError(f"no {tag} line in {server.log_path}:\n{server.log_text()}")


def test_the_reason_is_the_schedulers_traceback_not_the_launchers_own():
    assert failure_reason(HOST_POOL_REFUSED).startswith(REASON)
    launcher_after = HOST_POOL_REFUSED + (
        "Traceback (most recent call last):\n  File \"engine.py\"\n"
        "RuntimeError: Rank 0 scheduler is dead. Please check if there are relevant logs.\n")
    assert failure_reason(launcher_after).startswith(REASON)
    assert failure_reason("[2026-12-06] starting\n[2026-12-06] Load weight begin\n") is None


def test_a_server_that_fails_to_start_names_sglangs_reason_on_the_first_line(tmp_path):
    server = SGLangServer(StandIn(model_path="unused", code=fails_like_sglang()), tmp_path, name="refused")
    with pytest.raises(ServerError) as exc:
        server.start()
    first = str(exc.value).splitlines()[0]
    assert first.startswith("refused exited with status 1 while starting: " + REASON), first
    assert server.log_path in first


@pytest.fixture
def demo_server_fails_like_sglang(monkeypatch):
    monkeypatch.setattr(ServerConfig, "launch_args", lambda self, port: StandIn(
        model_path="unused", code=fails_like_sglang()).launch_args(port))


def demo_error(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, the ``error:`` line, all of stderr) of a server demo."""
    from sglang_simm_dev import cli

    code = cli.main(["demo", "--server", "--preset", "llama-tiny", *argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return code, errors[0], err


def test_the_server_demo_prints_sglangs_reason_when_its_server_does_not_start(
        tmp_path, capsys, demo_server_fails_like_sglang):
    """What a failing e2e demo test shows: the reason on stderr, beside the
    log's path and its last lines (the test's assertion shows both streams)."""
    code, error, err = demo_error(capsys, "--model-dir", str(tmp_path / "model"), "--workdir", str(tmp_path / "work"))
    assert code == 1
    assert error.startswith("error: demo-server exited with status 1 while starting: " + REASON), err
    assert str(tmp_path / "work" / "demo-server.log") in error
    assert "last lines of the server's log:" in err and "Received sigquit" in err


def test_the_server_demo_keeps_its_server_log_in_the_cache_folder_not_the_temp_dir(
        tmp_path, monkeypatch, capsys, demo_server_fails_like_sglang):
    """Without --workdir the server's folder is ``sglang-simm/demo-server``
    under the cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``), beside
    the demo's models, as the README says; its log stays there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, error, err = demo_error(capsys)
    log = tmp_path / "cache" / "sglang-simm" / "demo-server" / "demo-server.log"
    assert code == 1 and f"log {log}:" in error, err
    assert "Not enough host memory" in log.read_text()
    assert (tmp_path / "cache" / "sglang-simm" / "models" / "llama-tiny-seed0" / "config.json").exists()


def test_a_relative_working_folder_names_the_same_place_from_inside_the_server(tmp_path, monkeypatch):
    """The server runs in its working folder: a relative one, given to the
    demo as --workdir, put the stand-ins' sitecustomize out of its reach
    (``No module named 'sgl_kernel'``)."""
    monkeypatch.chdir(tmp_path)
    probe = ("import os, sys; first = os.environ['PYTHONPATH'].split(os.pathsep)[0]; "
             "print('SITE', first, os.path.isfile(os.path.join(first, 'sitecustomize.py')), flush=True); "
             "import time; time.sleep(600)")
    server = SGLangServer(StandIn(model_path="unused", code=probe), "rel/work", name="relative")
    try:
        site, found = logged(server.launch(), "SITE")
    finally:
        server.stop(timeout=5, grace=5)
    assert (site, found) == (str(tmp_path / "rel" / "work" / "site"), "True")


def test_the_servers_temporary_files_live_in_its_own_folder_and_go_with_it(tmp_path):
    """SGLang names its IPC sockets and its metrics' folder with tempfile,
    and leaves them when it ends by a signal: a TMPDIR of the server's own,
    removed by ``stop``."""
    probe = ("import tempfile, time; f = tempfile.NamedTemporaryFile(delete=False); "
             "print('TMP', f.name, flush=True); time.sleep(600)")
    server = SGLangServer(StandIn(model_path="unused", code=probe), tmp_path / "work", name="tmp")
    try:
        [made] = logged(server.launch(), "TMP")
        assert made.startswith(str(tmp_path / "work" / "tmp") + os.sep) and os.path.exists(made)
    finally:
        server.stop(timeout=5, grace=5)
    assert not os.path.exists(made) and not (tmp_path / "work" / "tmp").exists()
    assert (tmp_path / "work" / "tmp.log").exists()  # the log stays


def test_keep_running_names_the_doctor_command_and_lasts_as_long_as_the_server(tmp_path, capsys):
    """``demo --server --keep-running``: the server a reader points
    ``sglang-simm doctor --server`` at, up until Ctrl-C or its own end."""
    from sglang_simm_dev.server_demo import keep_running

    server = SGLangServer(StandIn(model_path="unused", code="import time; time.sleep(1)"), tmp_path, name="kept")
    try:
        started = time.monotonic()
        keep_running(server.launch(), poll_s=0.05)
        assert time.monotonic() - started >= 0.9 and server.proc.poll() is not None
    finally:
        server.stop(timeout=5, grace=5)
    out = capsys.readouterr().out
    assert f"sglang-simm doctor --server http://127.0.0.1:{server.port}" in out and "Ctrl-C stops it" in out


def test_a_working_folder_too_deep_for_sglangs_sockets_gets_a_tmpdir_of_its_own_elsewhere(tmp_path):
    """SGLang binds unix sockets in TMPDIR (108 bytes at most per path):
    under a deep working folder the server's TMPDIR is a private folder in
    the system's temp dir instead, removed all the same."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    probe = "import os, time; print('TMPDIR', os.environ['TMPDIR'], flush=True); time.sleep(600)"
    server = SGLangServer(StandIn(model_path="unused", code=probe), deep, name="deep")
    try:
        [tmpdir] = logged(server.launch(), "TMPDIR")
        assert len(tmpdir) + len("/tmpXXXXXXXX") <= 107 and os.path.isdir(tmpdir)
        assert os.path.basename(tmpdir).startswith("sglang-simm-server-")
    finally:
        server.stop(timeout=5, grace=5)
    assert not os.path.exists(tmpdir)
