"""The servers ``bench --server`` compares: one ``ServerConfig`` per backend,
the same model, flags and pool sizes for each, and what each needs outside
the server (a local store, a folder, a Mooncake master).

* ``ours``: this plugin on a local store of the bench's own (``local://NAME``);
* ``ours-events``, ``ours-events-stalled``: the same, each on a store of its
  own, with its L3 event stream on (``kv_events``): read by a subscriber
  that keeps up, or by one that connected and stopped reading, past a
  high-water mark of ``STALLED_HWM`` batches (``server_events``);
* ``ours-disk``: the same on a store directory on a disk (``--disk-dir``,
  default the temp directory), its objects read and written through the
  page cache;
* ``file``: SGLang's ``file`` backend in a folder on /dev/shm (memory, like
  ``ours``), or on the same disk as ``ours-disk``'s store when ``ours-disk``
  runs beside it (so the two compare on one medium);
* ``mooncake``: SGLang's Mooncake Store over TCP, its segment inside the
  server, with a ``mooncake_master`` the bench starts on 127.0.0.1;
* ``mooncake-standalone``: the same, its segment in a ``mooncake_client``
  process the bench starts (SGLang's ``standalone_storage``: the host pool
  in Mooncake's shared memory, the transfers done by that process), the
  shape that outlives a server's restart, as ours does;
* ``host``: HiCache with the host tier only (no L3);
* ``none``: no HiCache (the device prefix cache alone).

Mooncake is optional: ``mooncake_status`` says whether the server's Python
imports it and where its master binary is, and otherwise gives the install
line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_simm_dev.sglang_server import ServerConfig, free_port

#: ours with its L3 event stream on: a subscriber reading, one stalled
EVENT_BACKENDS = ("ours-events", "ours-events-stalled")
#: ours on a store directory on a disk
DISK_BACKENDS = ("ours-disk",)
#: this plugin's servers, each on a local store of its own
OURS_BACKENDS = ("ours", *EVENT_BACKENDS, *DISK_BACKENDS)
#: every backend the bench knows, in its order
BACKENDS = ("ours", *EVENT_BACKENDS, "file", *DISK_BACKENDS, "mooncake", "mooncake-standalone", "host", "none")
#: what runs when ``--backends`` is not given (one Mooncake server)
DEFAULT_BACKENDS = ("ours", "file", "mooncake", "host", "none")
#: the Mooncake servers: both need its master
MOONCAKE_BACKENDS = ("mooncake", "mooncake-standalone")
#: the ones with an L3 tier (restarts, L3 reads)
L3_BACKENDS = (*OURS_BACKENDS, "file", "mooncake", "mooncake-standalone")
#: those whose L3 outlives the server, so a restart must find its pages
#: again (``mooncake``'s segment lives inside the server: a restart loses it)
RESTART_KEEPS_L3 = (*OURS_BACKENDS, "file", "mooncake-standalone")

#: ZMQ's high-water mark of the stalled subscriber's stream, in batches: a
#: run publishes far more, so the stream runs past it (ZMQ drops for it)
STALLED_HWM = 4

#: what to run when Mooncake does not import (the Debian libraries are what
#: its binaries link against)
MOONCAKE_INSTALL = (
    "pip install mooncake-transfer-engine-non-cuda && "
    "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
)

#: SiMM's default request time limit is 1 s; CPU servers side by side on a
#: shared machine have held an answer longer (see tests/e2e/conftest.py)
REQUEST_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class Shape:
    """What every server shares (so they differ only in their L3 tier)."""

    model_path: str
    page_size: int = 16
    #: the device (L1) pool in tokens; the host pool is ``hicache_ratio`` x
    device_tokens: int = 8192
    hicache_ratio: float = 2.0
    #: the L3 capacity of ours (local store) and Mooncake (its segment), alike
    l3_bytes: int = 2 << 30
    python: str = ""
    startup_timeout_s: float = 900.0

    def config(self, **fields: Any) -> ServerConfig:
        base = ServerConfig(
            model_path=self.model_path, page_size=self.page_size, max_total_tokens=self.device_tokens,
            hicache_ratio=self.hicache_ratio, enable_metrics=True, sleep_on_idle=True,
            startup_timeout_s=self.startup_timeout_s, prefetch_policy="wait_complete",
            **({"python": self.python} if self.python else {}),
        )
        return replace(base, **fields)


@dataclass
class MooncakeStatus:
    available: bool
    master: str | None = None
    why: str = ""
    #: the ``mooncake_client`` binary (``mooncake-standalone``), or None
    client: str | None = None


def mooncake_status(python: str) -> MooncakeStatus:
    """Whether ``python`` imports Mooncake's store and its ``mooncake_master``
    is there (next to ``python`` or on ``PATH``)."""
    probe = subprocess.run(
        [python, "-c", "from mooncake.store import MooncakeDistributedStore"],
        capture_output=True, text=True, timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return MooncakeStatus(False, why=f"{python} cannot import mooncake.store ({last}); install: {MOONCAKE_INSTALL}")
    master, client = (_binary(python, name) for name in ("mooncake_master", "mooncake_client"))
    if not master:
        return MooncakeStatus(False, why=f"mooncake.store imports but no mooncake_master binary; install: {MOONCAKE_INSTALL}")
    return MooncakeStatus(True, master=master, client=client or None)


def _binary(python: str, name: str) -> str:
    """``name`` next to ``python``, else on ``PATH``, else ``""``."""
    path = os.path.join(os.path.dirname(python), name)
    return path if os.access(path, os.X_OK) else shutil.which(name) or ""


class MooncakeProcess:
    """A Mooncake binary on 127.0.0.1 with a free port, ready once that port
    accepts, stopped by its pid."""

    what = "mooncake"

    def __init__(self, binary: str, log_path: str) -> None:
        self.binary = binary
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> MooncakeProcess:
        import socket

        self.port = free_port()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}; log {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.what} did not listen on {self.address} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


class MooncakeMaster(MooncakeProcess):
    """``mooncake_master``: the metadata every Mooncake client asks."""

    what = "mooncake_master"

    def args(self) -> list[str]:
        # its HTTP metrics server would take a fixed port on every interface
        return [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]


class MooncakeClient(MooncakeProcess):
    """``mooncake_client``: a standalone Mooncake client holding the segment
    (``segment_bytes``) and doing the transfers for the servers that attach
    to it (SGLang's ``standalone_storage``). Its transfer engine, like the
    in-server one, listens on every interface whatever ``--host`` says."""

    what = "mooncake_client"

    def __init__(self, binary: str, log_path: str, *, master: str, segment_bytes: int) -> None:
        super().__init__(binary, log_path)
        self.master = master
        self.segment_bytes = segment_bytes

    def args(self) -> list[str]:
        return [self.binary, f"--master_server_address={self.master}", "--host=127.0.0.1",
                f"--port={self.port}", f"--global_segment_size={self.segment_bytes}", "--protocol=tcp",
                "--metadata_server=P2PHANDSHAKE", "--threads=2"]


@dataclass
class Environment:
    """What the backends need outside their servers; ``close()`` removes it."""

    tag: str
    root: str
    tap_dir: str
    mooncake: MooncakeStatus
    master: MooncakeMaster | None = None
    client: MooncakeClient | None = None
    file_dir: str = ""
    stores: list[str] = field(default_factory=list)
    #: why ``mooncake-standalone`` cannot run, when it cannot
    standalone_why: str = ""
    #: the bench's own connection to each local store it started (by name)
    held: dict[str, Any] = field(default_factory=dict)
    #: the L3 event endpoint of each ``EVENT_BACKENDS`` server (``tcp://*:PORT``)
    event_endpoints: dict[str, str] = field(default_factory=dict)
    #: this run's folder on a disk (``DISK_BACKENDS``' store directory, and
    #: ``file``'s folder beside it when they run together); "" when none
    disk_root: str = ""

    @classmethod
    def create(cls, python: str, *, want_mooncake: bool, workdir: str, want_standalone: bool = False,
               segment_bytes: int = 2 << 30, disk_dir: str | None = None, file_on_disk: bool = False
               ) -> Environment:
        """``disk_dir``: where to make the folder on a disk (needed by
        ``DISK_BACKENDS``; ValueError when it is no disk); ``file_on_disk``:
        ``file``'s folder there too, else on /dev/shm."""
        from sglang_simm.local_store.admin import medium_of

        tag = f"bench-{os.getpid()}"
        disk_root = ""
        if disk_dir is not None:
            if not os.path.isdir(disk_dir) or medium_of(disk_dir) != "disk":
                raise ValueError(f"--disk-dir must be a directory on a disk, got {disk_dir!r} "
                                 f"({'not a directory' if not os.path.isdir(disk_dir) else 'memory'})")
            disk_root = tempfile.mkdtemp(prefix=f"sglang-simm-{tag}-disk-", dir=disk_dir)
            os.makedirs(os.path.join(disk_root, "store"), mode=0o700)
        mooncake = mooncake_status(python) if want_mooncake else MooncakeStatus(False, why="not asked for")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        file_dir = tempfile.mkdtemp(prefix=f"sglang-simm-{tag}-file-",
                                    dir=disk_root if disk_root and file_on_disk else shm)
        env = cls(tag=tag, root=workdir, tap_dir=os.path.join(workdir, "tap"), mooncake=mooncake, file_dir=file_dir,
                  disk_root=disk_root)
        if mooncake.available:
            try:
                env.master = MooncakeMaster(mooncake.master, os.path.join(workdir, "mooncake_master.log")).start()
            except RuntimeError as exc:
                env.mooncake = MooncakeStatus(False, why=str(exc))
        if want_standalone and env.master is not None and mooncake.client:
            try:
                env.client = MooncakeClient(mooncake.client, os.path.join(workdir, "mooncake_client.log"),
                                            master=env.master.address, segment_bytes=segment_bytes).start()
            except RuntimeError as exc:
                env.client = None
                env.standalone_why = str(exc)
        elif want_standalone:
            env.standalone_why = env.mooncake.why or "no mooncake_client binary next to the servers' Python"
        return env

    def available(self, backend: str) -> bool:
        """Whether ``backend``'s server can run here (Mooncake's may not)."""
        if backend == "mooncake":
            return self.master is not None
        if backend == "mooncake-standalone":
            return self.client is not None
        return True

    @property
    def ours_store(self) -> str:
        return self.store_of("ours")

    def store_of(self, backend: str) -> str:
        """The local store of one of ``OURS_BACKENDS``: each its own, so no
        server finds another's pages."""
        return f"{self.tag}-{backend}"

    def store_dir_of(self, backend: str) -> str | None:
        """The store directory of one of ``OURS_BACKENDS``: the disk's for
        ``DISK_BACKENDS``, else None (the default, /dev/shm)."""
        if backend not in DISK_BACKENDS:
            return None
        if not self.disk_root:
            raise RuntimeError(f"{backend} needs a folder on a disk: Environment.create(disk_dir=...)")
        return os.path.join(self.disk_root, "store")

    def l3_dir(self, backend: str) -> str | None:
        """The folder holding ``backend``'s L3 files (ours': its store
        directory; ``file``'s folder), or None (Mooncake, no L3)."""
        if backend in OURS_BACKENDS:
            from sglang_simm.local_store.admin import store_dir

            return self.store_dir_of(backend) or store_dir(None)
        return self.file_dir if backend == "file" else None

    def drop_l3_cache(self, backend: str) -> dict[str, Any]:
        """Write ``backend``'s L3 files out and drop them from the page cache
        (``POSIX_FADV_DONTNEED``: what ``drop_caches`` does, file by file), so
        the next reads of them are cold; on memory (tmpfs) there is nothing
        to drop. What was there, and what the page cache held before and after."""
        from sglang_simm.local_store.admin import medium_of

        root = self.l3_dir(backend)
        if root is None:
            return {"dir": None, "medium": None, "dropped": False}
        medium = medium_of(root)
        files = _l3_files(root, self.store_of(backend) if backend in OURS_BACKENDS else None)
        out = {"dir": root, "medium": medium, "dropped": medium == "disk", "files": len(files),
               "bytes": sum(_size(f) for f in files), "resident_before": _resident(files)}
        if medium == "disk":
            drop_page_cache(files)
        out["resident_after"] = _resident(files)
        return out

    def hold_store(self, shape: Shape, *, idle_exit_s: float | None = None, backend: str = "ours") -> None:
        """Start the local store of ``backend`` (one of ``OURS_BACKENDS``)
        here and keep a connection to it until ``close()``. A store a server
        started exits ``local_store_idle_exit_s`` (600 s) after its last
        client left, and its objects with it: between
        the stop of the first servers and the start of the restarted ones,
        which took 751 s side by side in run 1, it would have emptied the
        L3 the restart is meant to find again. The bench's connection keeps
        it a client; if the bench dies, the idle exit still frees it."""
        from sglang_simm.local_store.admin import DEFAULT_IDLE_EXIT_S, StoreHandle

        store = self.store_of(backend)
        if store in self.held:
            return
        handle = StoreHandle(store, root=self.store_dir_of(backend), capacity=shape.l3_bytes,
                             timeout_s=REQUEST_TIMEOUT_MS / 1000,
                            idle_exit_s=DEFAULT_IDLE_EXIT_S if idle_exit_s is None else idle_exit_s)
        handle.open()
        self.held[store] = handle
        if store not in self.stores:
            self.stores.append(store)

    def config(self, backend: str, shape: Shape) -> ServerConfig:
        """``backend``'s server (one of ``BACKENDS``)."""
        if backend in OURS_BACKENDS:
            store = self.store_of(backend)
            if store not in self.stores:
                self.stores.append(store)
            extra: dict[str, Any] = {"manager_address": f"local://{store}", "request_timeout_ms": REQUEST_TIMEOUT_MS,
                                     "local_store_capacity_bytes": shape.l3_bytes}
            if backend in DISK_BACKENDS:
                extra["local_store_dir"] = self.store_dir_of(backend)
            if backend in EVENT_BACKENDS:
                endpoint = self.event_endpoints.setdefault(backend, f"tcp://*:{free_port()}")
                extra["kv_events"] = {"publisher": "zmq", "endpoint": endpoint, "topic": "l3",
                                      **({"hwm": STALLED_HWM} if backend == "ours-events-stalled" else {})}
            return shape.config(route="simm", extra_config=extra)
        if backend == "file":
            return shape.config(route="file", extra_config={"file_storage_path": self.file_dir})
        if backend == "mooncake":
            if self.master is None:
                raise RuntimeError(f"Mooncake is not available: {self.mooncake.why}")
            return shape.config(route="mooncake", extra_config={
                "master_server_address": self.master.address, "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE", "global_segment_size": shape.l3_bytes,
                "local_hostname": "127.0.0.1", "device_name": ""})
        if backend == "mooncake-standalone":
            if self.client is None or self.master is None:
                raise RuntimeError(f"Mooncake's standalone client is not available: {self.standalone_why}")
            # the segment is the client process's (shape.l3_bytes there)
            return shape.config(route="mooncake", extra_config={
                "standalone_storage": True, "client_server_address": self.client.address,
                "master_server_address": self.master.address, "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0,
                "local_hostname": "127.0.0.1", "device_name": ""})
        if backend == "host":
            return shape.config(route=None)
        if backend == "none":
            return shape.config(hierarchical_cache=False)
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")

    def close(self) -> None:
        if self.client is not None:
            self.client.stop()
            self.client = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        from sglang_simm.local_store.admin import StoreHandle, StoreUnreachable

        roots = {self.store_of(b): self.store_dir_of(b) for b in DISK_BACKENDS if self.disk_root}
        for store in self.stores:
            try:
                (self.held.pop(store, None) or StoreHandle(store, root=roots.get(store), capacity=1, spawn=False,
                                                           data=False)).stop(discard=True)
            except (StoreUnreachable, OSError):
                pass
        shutil.rmtree(self.file_dir, ignore_errors=True)
        if self.disk_root:
            shutil.rmtree(self.disk_root, ignore_errors=True)


def _l3_files(root: str, store: str | None) -> list[str]:
    """The regular files of an L3 folder: a store's segments and index
    (``store``), or every file below ``root``."""
    if store is not None:
        from sglang_simm.local_store.admin import StorePaths

        return [p for p in StorePaths(root, store).data_files() if os.path.isfile(p)]
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names
            if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f))]


def _size(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _resident(files: list[str]) -> int:
    from sglang_simm_dev.bench.disk import resident_bytes

    total = 0
    for path in files:
        with contextlib.suppress(OSError):
            total += resident_bytes(path)
    return total


def drop_page_cache(files: list[str]) -> None:
    """Each file's dirty pages written out, then its pages dropped from the page cache."""
    from sglang_simm_dev.bench.disk import sync

    sync(files, drop=True)
