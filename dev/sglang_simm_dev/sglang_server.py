"""A real ``python -m sglang.launch_server`` on this machine's CPU, with this
plugin as HiCache's L3 tier, for the end-to-end tests and the server demo.

:class:`SGLangServer` starts SGLang on 127.0.0.1 with a free port, the CPU
flags, HiCache on and the storage backend chosen by :class:`ServerConfig`
(``simm`` through the plugin entry point, or ``dynamic`` with the module
path and ``interface_v1``). The CUDA-only parts SGLang needs are replaced by
the stand-ins of :mod:`sglang_simm_dev.cpu_standins`, loaded into every
process of the server through a ``sitecustomize.py`` folder on
``PYTHONPATH`` (SGLang's scheduler is a spawned subprocess, so an import in
this process would not reach it). The log goes to a file; the server is
stopped by its pid, then by its process group if anything remains.

Helpers speak SGLang's HTTP API with the standard library only: ``/generate``
with ``input_ids`` (greedy, with logprobs, optionally streamed for the time to
first token), ``/flush_cache``, ``/metrics``; and the scheduler's resident
memory is read from the process tree. L3 pages stored and read are counted
by the backend's local store (``l3_counts``), never from the server's log.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from sglang_simm.local_store.admin import STORE_DIR_ENV
from sglang_simm_dev import cpu_standins, l3_counts

#: The names SGLang's scheduler processes give themselves (setproctitle),
#: e.g. ``sglang::scheduler`` or ``sglang::scheduler_TP1``.
SCHEDULER_TITLE = "sglang::scheduler"

#: The backend names of the two routes.
ROUTES = ("simm", "dynamic")

#: SGLang's own L3 backends, reached by name with their own extra config
#: (``file``: ``file_storage_path``; ``mooncake``: its master and transfer
#: settings), for comparisons with this plugin.
INTREE_BACKENDS = ("file", "mooncake")


class ServerError(RuntimeError):
    """The server did not start, died, or answered an error."""


@dataclass(frozen=True)
class ServerConfig:
    """How to launch one CPU SGLang server with HiCache and this plugin."""

    model_path: str
    #: ``simm`` (the plugin entry point), ``dynamic`` (module path and
    #: ``interface_v1``), or None for HiCache without an L3 tier
    route: str | None = "simm"
    #: this backend's extra config (``manager_address: local`` = the host
    #: store, a store process shared by every scheduler of this user)
    extra_config: Mapping[str, Any] = field(default_factory=lambda: {"manager_address": "local"})
    #: the model's dtype; SGLang's "auto" serves an fp32 checkpoint as fp16
    dtype: str = "float32"
    page_size: int = 16
    #: the device (L1) pool, in tokens; the host pool is ``hicache_ratio`` times it
    max_total_tokens: int = 4096
    hicache_ratio: float = 2.0
    mem_layout: str = "page_first"
    io_backend: str = "kernel"
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    enable_metrics: bool = False
    tp_size: int = 1
    #: further ``launch_server`` arguments, appended last
    extra_args: Sequence[str] = ()
    #: further environment variables for the server
    env: Mapping[str, str] = field(default_factory=dict)
    #: the Python that runs SGLang (one where SGLang and this package are installed)
    python: str = sys.executable
    startup_timeout_s: float = 600.0
    #: False: no ``--enable-hierarchical-cache`` (and no L3): the device
    #: prefix cache alone, the baseline an operator starts from
    hierarchical_cache: bool = True
    #: ``--sleep-on-idle``: an idle CPU scheduler otherwise spins at 20-40 %
    #: of a core, which spoils runs of several servers side by side
    sleep_on_idle: bool = False
    #: folders put on the server's ``PYTHONPATH`` after the stand-ins' own
    #: (a ``sitecustomize.py`` there runs after theirs, see
    #: ``cpu_standins.chain_sitecustomize``)
    pythonpath: Sequence[str] = ()
    #: objects of one L3 page, for counting pages from the local store's
    #: counters; None: from the model's config.json (MLA 1, else 2)
    l3_objects_per_page: int | None = None

    def storage_args(self) -> list[str]:
        if self.route is None:
            return []
        extra = dict(self.extra_config)
        if self.route == "dynamic":
            extra = {
                "backend_name": "simm",
                "module_path": "sglang_simm",
                "class_name": "HiCacheSiMM",
                "interface_v1": 1,
                **extra,
            }
        elif self.route not in ("simm", *INTREE_BACKENDS):
            raise ValueError(f"route must be one of {ROUTES + INTREE_BACKENDS} or None, got {self.route!r}")
        return [
            "--hicache-storage-backend",
            self.route,
            "--hicache-storage-backend-extra-config",
            json.dumps(extra, sort_keys=True),
            "--hicache-storage-prefetch-policy",
            self.prefetch_policy,
        ]

    def launch_args(self, port: int) -> list[str]:
        """The whole command line (pure)."""
        args = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--skip-tokenizer-init",  # requests carry input_ids (see tiny_model)
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
            "--dtype",
            self.dtype,
            "--tp-size",
            str(self.tp_size),
            "--page-size",
            str(self.page_size),
            "--max-total-tokens",
            str(self.max_total_tokens),
        ]
        if self.hierarchical_cache:
            args += [
                "--enable-hierarchical-cache",
                "--hicache-ratio",
                str(self.hicache_ratio),
                "--hicache-mem-layout",
                self.mem_layout,
                "--hicache-io-backend",
                self.io_backend,
                "--hicache-write-policy",
                self.write_policy,
                *self.storage_args(),
            ]
        if self.sleep_on_idle:
            args.append("--sleep-on-idle")
        if self.enable_metrics:
            args.append("--enable-metrics")
        args.extend(self.extra_args)
        return args


#: uvicorn's line when the server's port is taken
BIND_FAILED = "error while attempting to bind on address"

#: where :func:`free_port` looks: below the kernel's ephemeral range and
#: below SGLang's own picks (22000-29999, ``get_free_port_below_ephemeral``)
PORT_RANGE = (12000, 21999)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(attempts: int = 64) -> int:
    """A TCP port free on 127.0.0.1 right now, for a server that binds it
    only after it has started its children: below the ephemeral range, as
    SGLang picks its own such ports. A port from ``bind(0)`` may be handed
    out again meanwhile to any socket bound to port 0, such as the gloo
    listener of that server's own scheduler, and the server then fails to
    bind it while its launcher keeps running."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low() - 1)
    if high - low >= attempts:
        for port in random.sample(range(low, high + 1), attempts):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(config: ServerConfig, workdir: str, tmpdir: str | None = None) -> dict[str, str]:
    """The server's environment: the CPU engine, no CUDA device, the stand-ins'
    ``sitecustomize`` first on ``PYTHONPATH``, no hub access, logs, temporary
    files and build caches under ``workdir`` or the venv. Every path is
    absolute: the server runs in ``workdir``, where a relative one would
    name another place."""
    workdir = os.path.abspath(workdir)
    env = dict(os.environ)
    site_dir = cpu_standins.write_sitecustomize(os.path.join(workdir, "site"))
    paths = (site_dir, *(os.path.abspath(p) for p in config.pythonpath), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # SGLang names its IPC sockets and its metrics' multiprocess folder with
    # tempfile (and leaves them behind when it ends by a signal): a folder of
    # this server's own, removed when it stops (``SGLangServer.stop``)
    env["TMPDIR"] = tmpdir or make_server_tmpdir(workdir)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("SGLANG_SIMM_LOG_DIR", os.path.join(workdir, "simm-logs"))
    # SGLang JIT-builds a C++ page-hash extension on first use (torch's
    # cpp_extension runs `ninja`): the venv's own bin first, so a `ninja`
    # installed with pip is found; and one build per venv, not one shared
    # folder for every venv and user of the machine.
    bindir = os.path.dirname(config.python)
    env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
    prefix = os.path.dirname(bindir)
    if "TORCH_EXTENSIONS_DIR" not in env and os.access(prefix, os.W_OK):
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(prefix, "torch_extensions")
    env.update(config.env)
    return env


#: the longest path a unix socket can bind (``sun_path``: 108 bytes with its NUL)
_SOCKET_PATH_MAX = 107
#: what SGLang's IPC socket names add to ``TMPDIR`` (tempfile's ``/tmpXXXXXXXX``)
_IPC_NAME_LEN = len("/tmpXXXXXXXX")


def make_server_tmpdir(workdir: str) -> str:
    """The server's ``TMPDIR``, made: ``tmp`` in its working folder, or,
    where that path is too long for the unix sockets SGLang names in it, a
    folder of its own in the system's temp dir (removed with it all the same)."""
    path = os.path.join(os.path.abspath(workdir), "tmp")
    if len(os.fsencode(path)) + _IPC_NAME_LEN > _SOCKET_PATH_MAX:
        return tempfile.mkdtemp(prefix="sglang-simm-server-")
    os.makedirs(path, exist_ok=True)
    return path


#: the last line of a Python traceback: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?$")
#: what SGLang's launcher raises after a child died, which names no cause: the child's traceback does
_SECONDARY = ("scheduler is dead", "Initialization failed", "please see the error messages above",
              "check if there are relevant logs")


def failure_reason(log: str) -> str | None:
    """Why a server did not start, as its log says: uvicorn's line when the
    port was taken, else the last line of the first traceback that names a
    cause (SGLang's launcher adds one of its own after a child died, which
    names none; its child's comes first), else None."""
    lines = log.splitlines()
    for line in lines:
        if BIND_FAILED in line:
            return line.strip()
    found = [line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())]
    for line in found:
        if not any(words.lower() in line.lower() for words in _SECONDARY):
            return line
    return found[-1] if found else None


@dataclass
class Generation:
    """One /generate answer."""

    output_ids: list[int]
    #: logprob of each output token
    logprobs: list[float]
    prompt_tokens: int
    #: prefix tokens served from a cache tier
    cached_tokens: int
    #: SGLang's ``cached_tokens_details``: ``device``, ``host``, ``storage``,
    #: ``storage_backend`` (None when nothing was cached)
    cached_details: dict[str, Any] | None
    #: wall time of the whole request, seconds
    latency_s: float
    #: time to the first streamed chunk (None when not streamed)
    ttft_s: float | None = None

    @property
    def storage_tokens(self) -> int:
        return int((self.cached_details or {}).get("storage") or 0)

    @property
    def host_tokens(self) -> int:
        return int((self.cached_details or {}).get("host") or 0)

    @property
    def device_tokens(self) -> int:
        return int((self.cached_details or {}).get("device") or 0)


_PR_SET_PDEATHSIG = 1


def ends_with_launcher() -> Any:
    """A ``preexec_fn`` after which the child gets SIGTERM when the thread
    that launched it ends, however it ends (a test run or a demo killed by
    SIGKILL or a CI timeout included): servers run in a session of their
    own, so nothing else would stop them. SGLang's server ends its own
    children on SIGTERM. Linux only (elsewhere None: no ``preexec_fn``)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it ended before prctl took effect
            os._exit(1)

    return preexec


class SGLangServer:
    """One running server; use as a context manager (stopped whatever happens).

    The server also ends when the thread that launched it ends (see
    ``ends_with_launcher``): launch it from a thread that outlives it, such
    as the main thread."""

    def __init__(self, config: ServerConfig, workdir: str | os.PathLike, *, name: str = "server") -> None:
        self.config = config
        # absolute: the server runs in it, and a relative path would name a folder inside it
        self.workdir = os.path.abspath(os.fspath(workdir))
        os.makedirs(self.workdir, exist_ok=True)
        self.name = name
        self.log_path = os.path.join(self.workdir, f"{name}.log")
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        #: seconds from the launch to a healthy server
        self.started_in_s: float | None = None
        self._launched_at = 0.0
        self._l3: l3_counts.StoreCounter | None = None
        #: the server's ``TMPDIR`` while it runs (``make_server_tmpdir``)
        self.tmpdir: str | None = None
        self._shm: set[str] = set()  # /dev/shm files of a crashed server's processes, for stop()

    # -- life cycle -----------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> SGLangServer:
        """Launch and wait until healthy (stopped again if it is not)."""
        return self.launch().wait_ready()

    def launch(self) -> SGLangServer:
        """Launch without waiting (several servers then start side by side)."""
        if self.proc is not None:
            raise ServerError(f"{self.name} is already started (pid {self.proc.pid})")
        self.port = free_port()
        self.tmpdir = make_server_tmpdir(self.workdir)
        try:
            env = server_env(self.config, self.workdir, self.tmpdir)
            args = self.config.launch_args(self.port)
            self._launched_at = time.monotonic()
            with open(self.log_path, "w", encoding="utf-8") as log:
                log.write("$ " + " ".join(args) + "\n")
                log.flush()
                # Its own session, so that its process group can be ended as a whole.
                self.proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.workdir,
                    start_new_session=True,
                    preexec_fn=ends_with_launcher(),
                )
        except BaseException:  # no server: its TMPDIR goes at once
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
            raise
        return self

    def wait_ready(self, progress: Callable[[float], None] | None = None, every_s: float = 15.0) -> SGLangServer:
        """Wait until /health answers 200; on a timeout or an exit, stop it
        and raise with the log's tail. ``progress(seconds_since_launch)`` is
        called every ``every_s`` seconds while it starts."""
        if self.started_in_s is not None:
            return self
        if self.proc is None:
            raise ServerError(f"{self.name} was not launched")
        try:
            self._wait_healthy(self._launched_at, progress, every_s)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - self._launched_at
        return self

    def _wait_healthy(self, started: float, progress: Callable[[float], None] | None = None,
                      every_s: float = 15.0) -> None:
        deadline = started + self.config.startup_timeout_s
        next_report = started + every_s
        while True:
            if progress is not None and time.monotonic() >= next_report:
                progress(time.monotonic() - started)
                next_report += every_s
            code = self.proc.poll()
            if code is not None:
                raise self._start_failed(f"exited with status {code} while starting")
            if BIND_FAILED in self.log_text():  # its launcher waits on its children: it would never exit
                raise self._start_failed(f"could not bind port {self.port}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise self._start_failed(f"not healthy after {self.config.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def _start_failed(self, what: str) -> ServerError:
        """A failed start: what happened and SGLang's reason on the first
        line, then the log's path and its last lines (whoever prints one
        line of it still says why)."""
        reason = failure_reason(self.log_text())
        because = f": {reason}" if reason else " (no reason in its log)"
        return ServerError(f"{self.name} {what}{because}; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0, grace: float = 5.0) -> None:
        """SIGTERM to the server's pid (SGLang then ends its own children),
        SIGKILL to it after ``timeout``; then, after ``grace``, SIGKILL to its
        process group for anything left. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group is named by the leader's pid
        # SGLang's processes leave their load-report files in /dev/shm when
        # they end by a signal (SGLang sweeps them only in its own CI)
        shm_files = self._shm | _mapped_files([proc.pid, *_descendants(proc.pid)], SGLANG_SHM_PREFIX)
        self._shm = set()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if not _wait_group_gone(pgid, grace):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_group_gone(pgid, grace)
        for path in shm_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.tmpdir is not None:  # its processes are gone
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        self.proc = None
        counter, self._l3 = self._l3, None
        if counter is not None:
            counter.close()

    def crash(self) -> None:
        """Every process of the server killed at once (SIGKILL to its group),
        as a crash or a CI timeout does; ``stop`` still cleans up after it."""
        proc = self.proc
        if proc is None:
            return
        self._shm |= _mapped_files([proc.pid, *_descendants(proc.pid)], SGLANG_SHM_PREFIX)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> SGLangServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the log -----------------------------------------------------------------

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        # server_args is one very long line; cut every line short
        return "\n".join(line[:400] for line in self.log_text().splitlines()[-lines:])

    # -- L3 counts -------------------------------------------------------------

    def l3_counter(self) -> l3_counts.StoreCounter | None:
        """The counters of the local store this server's backend uses (its
        ``manager_address``: ``local`` or ``local://NAME``), read from this
        process; None for any other store."""
        if self._l3 is None:
            name = l3_counts.host_store_name(self.config.extra_config)
            if name is None:
                return None
            per_page = self.config.l3_objects_per_page or l3_counts.objects_per_page(self.config.model_path)
            # the server's store directory: its own env's, else the one it inherits from here
            root = self.config.env.get(STORE_DIR_ENV)
            self._l3 = l3_counts.StoreCounter(name, root=root, objects_per_page=per_page)
        return self._l3

    def _l3_pages(self, which: str) -> int:
        """``stored`` or ``read`` pages: from the local store's counters; for
        another store (a cluster, whose counters no other process reads),
        from SGLang's own metrics of the backend (``sglang:backup_pgs`` and
        ``sglang:prefetch_pgs``, pages per batch, warm-ups never in them),
        which need ``enable_metrics``."""
        counter = self.l3_counter()
        if counter is not None:
            from sglang_simm.local_store.admin import StoreUnreachable

            try:
                objects = counter.objects()
            except StoreUnreachable as exc:
                raise ServerError(f"{self.name}: cannot read its local store's counters: {exc}") from exc
            return l3_counts.pages(objects.stored if which == "stored" else objects.read, counter.objects_per_page)
        if not self.config.enable_metrics:
            raise ServerError(
                f"{self.name}: L3 pages are counted by the local store (manager_address 'local://NAME') or by "
                f"SGLang's metrics, and manager_address {self.config.extra_config.get('manager_address')!r} "
                "is no local store and metrics are off: give it a local store or enable_metrics")
        name = "sglang:backup_pgs_sum" if which == "stored" else "sglang:prefetch_pgs_sum"
        return int(self.metrics().get(name, 0.0))

    def l3_pages_stored(self) -> int:
        """Pages the backend stored in L3 (every page of every write, so a
        page written twice counts twice; warm-ups left out)."""
        return self._l3_pages("stored")

    def l3_pages_read(self) -> int:
        """Pages the backend read back from L3 (found; warm-ups left out)."""
        return self._l3_pages("read")

    def wait_l3_stored(self, at_least: int, timeout: float = 60.0) -> int:
        """Wait until ``l3_pages_stored() >= at_least`` (backups are
        asynchronous: the controller's backup thread writes after the request
        returned); the count reached. ``timeout`` is a generous bound on a
        loaded machine, not a speed check."""
        deadline = time.monotonic() + timeout
        while True:
            stored = self.l3_pages_stored()
            if stored >= at_least:
                return stored
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.name}: waited {timeout:.0f} s for {at_least} pages stored in L3, "
                    f"{stored} are; log {self.log_path}"
                )
            time.sleep(0.1)

    # -- HTTP --------------------------------------------------------------------

    def _request(self, path: str, body: Any = None, *, timeout: float = 300.0, method: str | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method or ("POST" if data is not None else "GET"),
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        return urllib.request.urlopen(request, timeout=timeout)

    def generate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 8,
        extra_key: str | None = None,
        stream: bool = False,
        timeout: float = 300.0,
    ) -> Generation:
        """Greedy generation from ``input_ids``, with the logprob of every
        output token. ``extra_key`` namespaces the prefix caches (every tier):
        a fresh computation of a prompt whose pages are cached elsewhere."""
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "return_logprob": True,
            "stream": stream,
        }
        if extra_key is not None:
            body["extra_key"] = extra_key
        started = time.perf_counter()
        ttft = None
        try:
            with self._request("/generate", body, timeout=timeout) as response:
                if not stream:
                    answer = json.load(response)
                else:
                    answer = None
                    for chunk in sse_chunks(response):
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        answer = chunk
                    if answer is None:
                        raise ServerError(f"{self.name}: the stream ended without a chunk")
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{self.name}: /generate answered {exc.code}: {exc.read()[:500]!r}") from exc
        latency = time.perf_counter() - started
        meta = answer["meta_info"]
        return Generation(
            output_ids=list(answer["output_ids"]),
            logprobs=[float(entry[0]) for entry in meta["output_token_logprobs"]],
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            cached_details=meta.get("cached_tokens_details"),
            latency_s=latency,
            ttft_s=ttft,
        )

    def flush_cache(self, timeout: float = 60.0) -> None:
        """Clear the device and host tiers (L3 stays). SGLang refuses while
        requests are in flight; retried until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self._request("/flush_cache", method="POST", timeout=timeout):
                    return
            except urllib.error.HTTPError as exc:
                if exc.code != 400 or time.monotonic() > deadline:
                    raise ServerError(f"{self.name}: /flush_cache answered {exc.code}: {exc.read()[:300]!r}") from exc
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` (needs ``enable_metrics``): each sample's value, summed
        over its labels, by name (``sglang:backuped_tokens_total``, ...)."""
        with self._request("/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    # -- processes ---------------------------------------------------------------

    def scheduler_pids(self) -> list[int]:
        """The scheduler processes (one per TP rank) in the server's tree."""
        if self.pid is None:
            return []
        return [pid for pid in _descendants(self.pid) if _title(pid).startswith(SCHEDULER_TITLE)]

    def scheduler_rss_bytes(self, kind: str = "RssAnon") -> int:
        """Resident memory of the scheduler processes together: ``RssAnon``
        (their private memory, where a leak of theirs shows; the default),
        ``RssShmem`` (shared memory they touched, e.g. the local store's arena)
        or ``VmRSS`` (everything)."""
        pids = self.scheduler_pids()
        if not pids:
            raise ServerError(f"{self.name}: no {SCHEDULER_TITLE} process under pid {self.pid}")
        return sum(_rss_bytes(pid, kind) for pid in pids)


def sse_chunks(response) -> Iterator[dict]:
    """The JSON of every ``data:`` line of a server-sent-events body, up to ``[DONE]``."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


# -- /proc --------------------------------------------------------------------------


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: split after the last ')'
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children = _children_map()
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


#: what a server's processes leave in /dev/shm (``load_snapshot.shm_path_for``)
SGLANG_SHM_PREFIX = "/dev/shm/sglang_loads_"


def _mapped_files(pids: list[int], prefix: str) -> set[str]:
    """The files under ``prefix`` that any of ``pids`` has mapped."""
    out: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith(prefix):
                        out.add(path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def _rss_bytes(pid: int, kind: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(f"{kind}:"):
                return int(line.split()[1]) * 1024
    raise ServerError(f"no {kind} for pid {pid}")
