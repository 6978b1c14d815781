"""The local store's opt-in HTTP /metrics (``_metrics.serve_from_env``): the
names of ``store status --prometheus``, from a real store process."""

from __future__ import annotations

import ctypes
import socket
import urllib.error
import urllib.request

import pytest

from polling import until
from sglang_simm.local_store._handle import StoreHandle
from sglang_simm.local_store._metrics import PORT_ENV, serve_from_env
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, INVALID_ARGUMENT, OK

pytestmark = pytest.mark.host


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


def _answers(url: str) -> bool:
    try:
        return fetch(url)[0] == 200
    except OSError:
        return False


def test_off_unless_the_environment_asks(root):
    assert serve_from_env(root, "x", environ={}) is None


def test_store_serves_its_metrics_over_http(store, monkeypatch):
    port = free_port()
    monkeypatch.setenv(PORT_ENV, str(port))  # the store process inherits it
    proc = store()
    client = StoreHandle(proc.paths.name, root=proc.paths.root, capacity=1, spawn=False, timeout_s=5)
    client.open()
    buf = ctypes.create_string_buffer(4096)
    assert client.put_from([("a", ctypes.addressof(buf), 4096), ("k" * 257, ctypes.addressof(buf), 4096)], True) \
        == [OK, INVALID_ARGUMENT]
    assert client.get_into([("a", ctypes.addressof(buf), 4096), ("b", ctypes.addressof(buf), 4096)]) == \
        [4096, DS_KEY_NOT_FOUND]
    client.close()
    url = f"http://127.0.0.1:{port}/metrics"
    until(lambda: _answers(url), what="the store's /metrics")
    status, text = fetch(url)
    assert status == 200, text
    assert fetch(f"http://127.0.0.1:{port}/other")[0] == 404
    labels = f'store="{proc.paths.name}",dir="{proc.paths.root}"'
    for line in (f"sglang_simm:store_up{{{labels}}} 1", f"sglang_simm:store_objects{{{labels}}} 1",
                 f"sglang_simm:store_hits_total{{{labels}}} 1", f"sglang_simm:store_misses_total{{{labels}}} 1",
                 f"sglang_simm:store_puts_total{{{labels}}} 1", f"sglang_simm:store_grants{{{labels}}} 0",
                 f'sglang_simm:store_refusals_total{{{labels},reason="key"}} 1',
                 f'sglang_simm:store_refusals_total{{{labels},reason="frame"}} 0'):
        assert line in text, text
    files = [ln for ln in text.splitlines() if ln.startswith(f"sglang_simm:store_files_bytes{{{labels}}}")]
    assert len(files) == 1 and int(files[0].rsplit(" ", 1)[1]) > 0, files
    assert "# TYPE sglang_simm:store_hits_total counter" in text
    assert "# TYPE sglang_simm:store_objects gauge" in text


def test_a_metrics_port_taken_leaves_the_store_serving_and_says_so(store, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        monkeypatch.setenv(PORT_ENV, str(taken.getsockname()[1]))
        proc = store()
        assert proc.status()["objects"] == 0
        until(lambda: "cannot serve /metrics" in proc.log_tail(8), what="the store to say why it serves no /metrics")
        assert PORT_ENV in proc.log_tail(8) and proc.alive()
