"""``doctor --server``'s analysis on recorded /server_info dicts (one cause
each); the real servers are tests/e2e/test_server.py."""

from __future__ import annotations

import json

import pytest

from sglang_simm.tools import doctor_server as ds
from sglang_simm.tools.cli import main

#: the fields of a 0.5.23 CPU server's /server_info that doctor reads
#: (recorded from the e2e tests' route-simm server, the rest left out)
HEALTHY = {
    "version": "0.5.23",
    "model_path": "/tmp/models/llama-tiny",
    "served_model_name": "/tmp/models/llama-tiny",
    "tp_size": 1,
    "pp_size": 1,
    "page_size": 16,
    "dtype": "float32",
    "kv_cache_dtype": "auto",
    "max_total_num_tokens": 2048,
    "enable_hierarchical_cache": True,
    "hicache_ratio": 2.0,
    "hicache_size": 0,
    "hicache_mem_layout": "page_first",
    "hicache_write_policy": "write_through",
    "hicache_storage_prefetch_policy": "wait_complete",
    "hicache_storage_backend": "simm",
    "hicache_storage_backend_extra_config": json.dumps({"manager_address": "local://e2e-route-simm"}),
    "enable_metrics": True,
}


def server(**changes):
    info = dict(HEALTHY)
    for k, v in changes.items():
        if v is None:
            info.pop(k, None)
        else:
            info[k] = v
    return info


def levels(findings, level):
    return [f.what for f in findings if f.level == level]


def test_healthy_server_blocks_nothing():
    found = ds.analyse(HEALTHY, {"sglang_simm:l3_pages_hit_total": [({}, 3.0)]})
    assert levels(found, "block") == []


@pytest.mark.parametrize(
    "changes, words, fix",
    [
        ({"enable_hierarchical_cache": False}, "HiCache is off", "--enable-hierarchical-cache"),
        ({"hicache_storage_backend": None}, "no L3 storage backend", "--hicache-storage-backend simm"),
        ({"hicache_storage_backend": "file"}, "SGLang's 'file' backend", "--hicache-storage-backend simm"),
        ({"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config":
          json.dumps({"module_path": "other.mod", "class_name": "X"})}, "other.mod.X", "sglang_simm"),
        # SGLang <= 0.5.14: prefetch capacity 0.8 x (host - device) = 0 at ratio 1.0
        ({"version": "0.5.11", "hicache_ratio": 1.0}, "0.8 x (2048 - 2048)", "--hicache-ratio 2"),
    ],
    ids=["hicache-off", "no-backend", "other-backend", "other-dynamic", "ratio-1.0-old-sglang"],
)
def test_each_blocking_cause_is_named_with_its_flag(changes, words, fix):
    found = ds.analyse(server(**changes))
    blocking = [f for f in found if f.level == "block"]
    assert blocking and words in blocking[0].what and fix in blocking[0].fix, found


def test_ratio_1_does_not_clamp_from_0_5_15():
    assert levels(ds.analyse(server(hicache_ratio=1.0)), "block") == []


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"hicache_write_policy": "write_back"}, "only when the GPU pool evicts it"),
        ({"hicache_write_policy": "write_through_selective"}, "hit twice"),
        ({"hicache_storage_prefetch_policy": "best_effort"}, "cut short"),
        ({"enable_metrics": False}, "metrics are off"),
        ({"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config":
          json.dumps({"module_path": "sglang_simm", "class_name": "HiCacheSiMM"})}, "interface_v1"),
    ],
    ids=["write-back", "selective", "best-effort", "metrics-off", "no-interface-v1"],
)
def test_each_warning_is_named(changes, words):
    found = ds.analyse(server(**changes))
    assert any(words in w for w in levels(found, "warn")), found
    assert levels(found, "block") == []


def test_threshold_above_the_prompts_served_blocks():
    metrics = {"sglang:prompt_tokens_total": [({}, 1000.0)], "sglang:num_requests_total": [({}, 10.0)],
               "sglang_simm:l3_pages_hit_total": [({}, 0.0)]}
    found = ds.analyse(HEALTHY, metrics)
    assert any("threshold is 256" in w and "average 100" in w for w in levels(found, "block")), found
    # the same prompts under a threshold of 64 are fine
    lower = server(hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": 64}))
    assert levels(ds.analyse(lower, metrics), "block") == []


def test_runtime_attachment_wins_over_launch_args():
    storage = {"hicache_storage_backend": None, "hicache_write_policy": "write_through"}
    assert any("no L3 storage backend" in w for w in levels(ds.analyse(HEALTHY, None, storage), "block"))


def test_in_tree_simm_is_told_apart_by_its_missing_series():
    metrics = {"sglang:prompt_tokens_total": [({}, 5000.0)], "sglang:num_requests_total": [({}, 10.0)]}
    assert any("in-tree HiCacheSiMM" in w for w in levels(ds.analyse(HEALTHY, metrics), "warn"))


def test_faults_and_open_breaker_from_metrics():
    metrics = {"sglang_simm:l3_faults_total": [({"code": "BuildConnectionFailed"}, 4.0)],
               "sglang_simm:breaker_state": [({}, 2.0)], "sglang_simm:l3_pages_hit_total": [({}, 0.0)]}
    found = ds.analyse(HEALTHY, metrics)
    assert any("BuildConnectionFailed x4" in w for w in levels(found, "warn"))
    assert any("breaker is open" in w for w in levels(found, "block"))


def test_parse_metrics():
    text = ('# HELP x y\n# TYPE x counter\nsglang_simm:l3_faults_total{code="a\\"b",tp_rank="0"} 3.0\n'
            'sglang:num_requests_total 7\n')
    parsed = ds.parse_metrics(text)
    assert parsed["sglang_simm:l3_faults_total"] == [({"code": 'a"b', "tp_rank": "0"}, 3.0)]
    assert ds.metric_sum(parsed, "sglang:num_requests_total") == 7
    assert ds.metric_sum(parsed, "absent") is None


def test_store_not_running_blocks():
    found = ds.analyse_store({"name": "e2e", "running": False, "why": "no store process is running"}, None)
    assert found[0].level == "block" and "sglang-simm store start e2e" in found[0].fix


def test_store_full_and_evicting_warns():
    found = ds.analyse_store({"name": "s", "running": True, "used_bytes": 95 << 20, "capacity_bytes": 100 << 20,
                              "evictions": 12}, [])
    assert any("full (95%" in w and "evicted 12" in w for w in levels(found, "warn"))


def test_store_namespaces_from_key_prefixes():
    keys = ["s1.0123456789abcdef/" + "a" * 64 + "_0_k", "s1.0123456789abcdef/" + "b" * 64 + "_0_v",
            "tag/s1.fedcba9876543210/" + "c" * 64 + "_k", "sglang_simm_warmup_x", "deadbeef_0_k"]
    assert ds.namespaces(keys) == {"s1.0123456789abcdef": 2, "tag/s1.fedcba9876543210": 1,
                                   "legacy (no namespace)": 1}
    found = ds.analyse_store({"name": "s", "running": True}, keys)
    assert any("3 key namespaces" in w for w in levels(found, "warn"))


def test_servers_sharing_a_store_with_different_namespaces():
    a = ("http://a", HEALTHY)
    b = ("http://b", server(tp_size=2))
    found = ds.compare_namespaces([a, b])
    assert found and "tp_size" in found[0].what and "http://b 2" in found[0].what
    assert ds.compare_namespaces([a, ("http://c", HEALTHY)]) == []


def test_cli_server_that_does_not_answer_exits_1(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["doctor", "--server", f"127.0.0.1:{port}"]) == 1
    out = capsys.readouterr().out
    assert "does not answer" in out and "keep L3 from hitting" in out


@pytest.fixture
def fake_server():
    """``fake_server(info, metrics_text, key=None)`` -> (URL, the
    Authorization headers seen) of an HTTP server on 127.0.0.1 that answers
    /server_info and /metrics as given; with ``key``, only requests with
    ``Authorization: Bearer KEY`` (as ``launch_server --api-key KEY`` does),
    others 401. Stopped at the end."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    started = []

    def serve(info: dict, metrics: str, key: str | None = None) -> tuple[str, list[str | None]]:
        seen: list[str | None] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                seen.append(self.headers.get("Authorization"))
                if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
                    self.send_response(401)
                    self.end_headers()
                    return
                body = {"/server_info": json.dumps(info).encode(), "/metrics": metrics.encode()}.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", seen

    yield serve
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def keyed_server(fake_server):
    """A server that answers only with ``Authorization: Bearer k3y``."""
    url, seen = fake_server(HEALTHY, "sglang_simm:l3_pages_hit_total 0\n", key="k3y")
    return url.removeprefix("http://"), seen


def test_an_api_key_reaches_every_endpoint_and_a_missing_one_is_named(keyed_server, capsys):
    url, seen = keyed_server
    view = ds.read_server(url, api_key="k3y")
    assert view.errors == [] and view.info["hicache_storage_backend"] == "simm"
    assert view.metrics is not None and set(seen) == {"Bearer k3y"}
    assert main(["doctor", "--server", url]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "HTTP 401" in out and "--api-key" in out
    assert main(["doctor", "--server", url, "--api-key", "wrong"]) == 1
    assert "not the server's" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------ the server's store, as it reports it


def store_info(store_dir: str, chosen_by: str = "env SGLANG_SIMM_STORE_DIR", address: str = "local://x") -> str:
    return (f'sglang_simm:l3_store_info{{model_name="m",tp_rank="0",pp_rank="0",dp_rank="",address="{address}",'
            f'store_dir="{store_dir}",store_dir_from="{chosen_by}"}} 1.0\n')


WORKING = ("sglang_simm:l3_pages_hit_total 63\nsglang_simm:l3_pages_written_total 64\n"
           'sglang:num_requests_total 4\nsglang:prompt_tokens_total 4096\n')


def test_doctor_reads_the_store_where_the_server_says_it_lives_and_names_why_its_shell_differs(
        fake_server, host_store_dir, monkeypatch, capsys):
    """The server's store lives in a directory its environment's
    SGLANG_SIMM_STORE_DIR names, which doctor's shell lacks: doctor reads
    that store (running: nothing blocks), and says where and why the two differ."""
    import os
    import uuid

    from sglang_simm.local_store.admin import StoreHandle

    name, elsewhere = f"t-{uuid.uuid4().hex[:8]}", os.path.join(host_store_dir, "elsewhere")
    store = StoreHandle(name, root=elsewhere, capacity=64 << 20)
    store.open()
    try:
        info = server(hicache_storage_backend_extra_config=json.dumps({"manager_address": f"local://{name}"}))
        url, _seen = fake_server(info, WORKING + store_info(elsewhere, address=f"local://{name}"))
        monkeypatch.delenv("SGLANG_SIMM_STORE_DIR")
        code = main(["doctor", "--server", url])
    finally:
        store.stop()
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert f"the server's local store '{name}' lives in {elsewhere}, as the server reports" in out
    assert f"the server's environment sets SGLANG_SIMM_STORE_DIR={elsewhere} and this shell lacks it" in out
    assert "is not running" not in out


def test_where_doctor_cannot_reach_the_store_the_servers_working_l3_wins():
    """A store doctor cannot reach, while the server's own counters show L3
    hitting: no block; the finding names where the views differ and why."""
    status = {"name": "x", "running": False, "why": "no store process is running"}
    found = ds.reconcile_store("x", "/dev/shm/mine", ("/dev/shm/theirs", "default"), status, None,
                               ds.parse_metrics(WORKING), shell_dir="/dev/shm/mine")
    assert levels(found, "block") == []
    text = " ".join(f.what for f in found)
    assert "lives in /dev/shm/theirs, as the server reports, not in /dev/shm/mine" in text
    assert "this shell sets SGLANG_SIMM_STORE_DIR=/dev/shm/mine" in text
    assert "doctor cannot reach the local store 'x' in /dev/shm/theirs" in text and "63 pages hit" in text
    # the same store with no sign of L3 at work in the server's counters: it blocks
    idle = ds.reconcile_store("x", "/dev/shm/mine", None, status, None, None, shell_dir=None)
    assert len(levels(idle, "block")) == 1 and "--enable-metrics makes the server report where" in idle[0].what


@pytest.mark.parametrize(("chosen_by", "shell_dir", "cause"), [
    ("env SGLANG_SIMM_STORE_DIR", None, "the server's environment sets SGLANG_SIMM_STORE_DIR=/s and this shell lacks it"),
    ("env SGLANG_SIMM_STORE_DIR", "/m", "the server's environment sets SGLANG_SIMM_STORE_DIR=/s and this shell sets it to /m"),
    ("default", "/m", "the server uses the default directory, and this shell sets SGLANG_SIMM_STORE_DIR=/m"),
    ("default", None, "it runs as another user"),
], ids=["env-unset-here", "env-set-here", "default-there", "another-user"])
def test_the_likely_cause_of_two_store_directories_is_named(chosen_by, shell_dir, cause):
    status = {"name": "x", "running": True, "used_bytes": 0, "capacity_bytes": 1 << 30}
    [apart] = levels(ds.reconcile_store("x", "/m", ("/s", chosen_by), status, None, None, shell_dir), "warn")
    assert cause in apart, apart
