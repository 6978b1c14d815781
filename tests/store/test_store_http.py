"""The local store's opt-in HTTP /metrics (embedded/_http.py): the
names of ``store status --prometheus``, from a real store process."""

from __future__ import annotations

import ctypes
import socket
import urllib.error
import urllib.request
import uuid

from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.local_store._metrics import PORT_ENV, store_metrics_from_env

from raw_peer import StoreProc  # noqa: E402
from polling import until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_off_unless_the_environment_asks():
    assert store_metrics_from_env("/nonexistent", "x", environ={}) is None


def test_store_serves_its_metrics_over_http(host_store_dir, monkeypatch):
    n = f"http-{uuid.uuid4().hex[:8]}"
    port = free_port()
    monkeypatch.setenv(PORT_ENV, str(port))  # the store process inherits it
    store = StoreProc(host_store_dir, n)
    try:
        client = StoreHandle(n, root=host_store_dir, capacity=1, spawn=False, timeout_s=5)
        client.open()
        buf = ctypes.create_string_buffer(4096)
        client.put_from([("a", ctypes.addressof(buf), 4096)], True)
        client.get_into([("a", ctypes.addressof(buf), 4096)])
        client.close()
        url = f"http://127.0.0.1:{port}/metrics"
        until(lambda: _answers(url), what="the store's /metrics")
        status, text = fetch(url)
        assert fetch(f"http://127.0.0.1:{port}/other")[0] == 404
    finally:
        store.stop()
    assert status == 200, text
    label = f'store="{n}"'
    for line in (f"sglang_simm:store_up{{{label}}} 1", f"sglang_simm:store_objects{{{label}}} 1",
                 f"sglang_simm:store_hits_total{{{label}}} 1", f"sglang_simm:store_puts_total{{{label}}} 1"):
        assert line in text, text
    assert "# TYPE sglang_simm:store_hits_total counter" in text


def _answers(url: str) -> bool:
    try:
        return fetch(url)[0] == 200
    except OSError:
        return False
