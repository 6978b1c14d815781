"""Real SGLang servers (``python -m sglang.launch_server``) on the CPU, with
this plugin as HiCache's L3 tier, driven over HTTP.

Every server the e2e tests use is named in ``SERVERS``. The first test that
asks for one launches all of them side by side (SGLang's start is mostly
imports, so two cores start three servers in much less than three times one
start), then waits for the one it needs. Each listens on 127.0.0.1 with a
free port and is stopped by its pid (then its process group) at the end of
the session, whatever happened; the local stores their schedulers start live
in the session's store directory and are stopped by their pids too
(tests/suite.py). Servers run their own processes with the CPU
stand-ins of ``sglang_simm_dev.cpu_standins`` (through ``sitecustomize``);
this pytest process never installs them.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from e2e_util import DEVICE_TOKENS, PAGE

from sglang_simm_dev.sglang_server import SGLangServer, ServerConfig, free_port
from sglang_simm_dev.tiny_model import write_model

#: SiMM's client gives a request 1 s (``request_timeout_ms``, its flag
#: ``clnt_sync_req_timeout_ms``). Three CPU servers and the tests on two
#: cores have held a store's answer past that for a moment (a backup then
#: fails, and a test that waits for its pages reads a miss), so these servers
#: wait longer. Timeouts themselves are tested in tests/store.
REQUEST_TIMEOUT_MS = 10_000


def _server(name: str, route: str, store: dict | None = None, *, store_of: str | None = None,
            **fields) -> Callable[[str], ServerConfig]:
    """A server's config, given the model directory: the tests' page size
    and device tokens, and a local store of its own (``local://e2e-NAME``,
    so servers never see each other's pages, and the tests count a server's
    L3 pages from its store's counters), or the store of the server
    ``store_of`` names; ``store`` adds extra-config fields."""
    extra = {"manager_address": f"local://e2e-{store_of or name}", "request_timeout_ms": REQUEST_TIMEOUT_MS,
             **(store or {})}
    # sleep_on_idle: an idle CPU scheduler otherwise spins at half a core,
    # which the rest of the suite pays for; SGLang's idle scheduler still
    # wakes every second, and backups run on the controller's own threads.
    return lambda model: ServerConfig(model_path=model, route=route, extra_config=dict(extra), page_size=PAGE,
                                      max_total_tokens=DEVICE_TOKENS, sleep_on_idle=True, **fields)


#: name -> the server's config, given the model directory
SERVERS: dict[str, Callable[[str], ServerConfig]] = {
    # the plugin entry point; page_first with the kernel io backend; metrics on;
    # SGLang's own KV event stream on and the plugin's (kv_events) off, the
    # server that announces nothing of L3 (tests/e2e/test_kv_events.py has
    # servers with it on)
    "route-simm": _server("route-simm", "simm", mem_layout="page_first", io_backend="kernel", enable_metrics=True,
                          extra_args=("--kv-events-config", json.dumps(
                              {"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}", "topic": "gpu"}))),
    # module path + interface_v1; page_first_direct with the direct io
    # backend; metrics off (SGLang's default); a small local store, which the
    # soak fills to capacity; SGLang 0.5.23's buffer_only host mode (the host
    # pool only stages transfers, every cached page lives in L3). Not a fifth
    # server: five leave too little host memory for SGLang's 10 GiB reserve
    # on a 24 GiB runner, and a server then fails to start
    "route-dynamic": _server("route-dynamic", "dynamic", {"local_store_capacity_bytes": "32MiB"},
                             mem_layout="page_first_direct", io_backend="direct", enable_metrics=False,
                             extra_args=("--hicache-host-memory-mode", "buffer_only")),
    # one cause that keeps L3 from hitting: a prefetch threshold above every
    # prompt the tests send (doctor --server must name it); metrics on. It
    # writes into corrupt-reads's store under a key namespace of its own
    # (extra_backend_tag): servers sharing a store whose pages are named
    # apart, another cause doctor --server must name, with no fifth server
    "l3-threshold": _server("l3-threshold", "simm", {"prefetch_threshold": 4096, "extra_backend_tag": "threshold"},
                            store_of="corrupt-reads", enable_metrics=True),
    # the control: every successful L3 read comes back with flipped bytes
    # (a fault of its own client, so l3-threshold, sharing its store, reads
    # true bytes); no warm-up round trip (it would see them and refuse to start)
    # every read's bytes flipped after the copy, by the test instrument's faulty network
    "corrupt-reads": _server("corrupt-reads", "simm", {"warmup": False},
                             env={"SGLANG_SIMM_FAULTS": '{"e2e-corrupt-reads": {"corrupt_rate": 1}}'}),
}

#: (name, seconds to healthy, log) of every server started, for the summary
_STARTED: list[tuple[str, float, str]] = []


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer fp32 Llama with random weights (seed 0), written locally."""
    return write_model(tmp_path_factory.mktemp("models") / "llama-tiny", "llama-tiny", seed=0)


class ServerPool:
    """Launches every server of ``SERVERS`` on first use; ``get(name)``
    waits for one to be healthy."""

    def __init__(self, model: str, root) -> None:
        self._model = model
        self._root = root
        self._servers: dict[str, SGLangServer] = {}

    def get(self, name: str) -> SGLangServer:
        if not self._servers:
            for each, config in SERVERS.items():
                server = SGLangServer(config(self._model), self._root / each, name=each)
                self._servers[each] = server
                server.launch()
        server = self._servers[name]
        if server.started_in_s is None:
            server.wait_ready()
            _STARTED.append((name, server.started_in_s, server.log_path))
        return server

    def stop_all(self) -> None:
        """Stop every server (a later ``get`` launches them again)."""
        servers, self._servers = self._servers, {}
        for server in servers.values():
            server.stop()


#: the session's pool, so the last e2e test can stop its servers
_POOL: list[ServerPool] = []


@pytest.fixture(scope="session")
def servers(tiny_llama, tmp_path_factory):
    pool = ServerPool(tiny_llama, tmp_path_factory.mktemp("servers"))
    _POOL.append(pool)
    try:
        yield pool
    finally:
        _POOL.remove(pool)
        pool.stop_all()


def pytest_runtest_teardown(item, nextitem):
    """The servers go when the e2e tests are done, not at the session's end:
    idle, they would hold memory (and CPU) through every later test."""
    here = item.path.parent
    if _POOL and (nextitem is None or here not in nextitem.path.parents):
        _POOL[0].stop_all()


def pytest_sessionfinish(session):
    # tests/suite.py prints these; an xdist worker hands them to its controller
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["e2e_servers_started"] = list(_STARTED)
    else:
        session.config.e2e_servers_started = list(_STARTED)
