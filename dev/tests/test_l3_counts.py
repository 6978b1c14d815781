"""L3 pages counted from the local store's counters (what the e2e tests and the
server demo wait on and assert), never from log lines: pages a backend
stored and read, exactly, with every warm-up round trip left out."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

from pages import fill_random, hashes, slots, tiny, tiny_mla
from sglang_simm_dev import l3_counts
from sglang_simm_dev.sglang_server import SGLangServer, ServerConfig, ServerError


@pytest.mark.parametrize("geom, per_page", [(tiny(), 2), (tiny_mla(), 1)], ids=["mha", "mla"])
def test_pages_counted_on_a_host_store_are_exact_and_leave_warm_ups_out(attach, store_name, geom, per_page):
    """A real store process, backends attached through SGLang's factory on
    real host pools (each attach one warm-up round trip), pages written
    and read: the counts are the backend's own, exactly."""
    backend, host = attach(geom)
    assert len(backend.pools.kv.suffixes) == per_page  # the objects a page of this pool is
    counter = l3_counts.StoreCounter(store_name, objects_per_page=per_page)
    try:
        objects = counter.objects()
        # the warm-up is in the store's counters, one object each way, and counted apart
        assert (objects.puts, objects.hits, objects.warmups) == (1, 1, 1)
        assert (counter.pages_stored(), counter.pages_read()) == (0, 0)
        again, again_host = attach(geom, model_name="another-model")  # a second attach: a second warm-up
        assert counter.objects().warmups == 2
        assert (counter.pages_stored(), counter.pages_read()) == (0, 0)

        fill_random(host, seed=3)
        keys = hashes(6)
        assert all(backend.batch_set_v1(keys[:5], slots(host, 0, 5)))
        assert counter.pages_stored() == 5
        assert all(backend.batch_set_v1(keys, slots(host, 0, 6)))  # five again and one new: every page counts
        assert counter.pages_stored() == 11 == backend.stats()["pages_written"]
        assert counter.objects().stored == 11 * per_page

        assert backend.batch_get_v1(keys[:3], slots(host, 8, 3)) == [True] * 3
        assert counter.pages_read() == 3
        assert backend.batch_get_v1(hashes(2, salt="absent"), slots(host, 8, 2)) == [False] * 2
        assert counter.pages_read() == 3 == backend.stats()["pages_read"]
        assert again.batch_get_v1(keys[:1], slots(again_host, 8, 1)) == [False]  # another model's keys: a miss
        assert counter.pages_read() == 3
    finally:
        counter.close()


def test_a_server_counts_its_pages_from_its_host_store(attach, store_name, tmp_path):
    """``SGLangServer`` reads the store its extra config names (no server
    needs to run for that), and waits on the count with a message that
    says what it waited for."""
    backend, host = attach(tiny())
    config = ServerConfig(model_path="unused", extra_config={"manager_address": f"local://{store_name}"},
                          l3_objects_per_page=2)
    server = SGLangServer(config, tmp_path, name="counted")
    fill_random(host, seed=4)
    assert (server.l3_pages_stored(), server.l3_pages_read()) == (0, 0)
    assert all(backend.batch_set_v1(hashes(4), slots(host, 0, 4)))
    assert server.wait_l3_stored(4) == 4
    with pytest.raises(ServerError, match="waited 0 s for 5 pages stored in L3, 4 are"):
        server.wait_l3_stored(5, timeout=0.0)
    server.stop()  # closes its connection to the store


def test_objects_per_page_follows_the_models_config(tmp_path):
    from sglang_simm_dev.tiny_model import write_model

    llama = write_model(tmp_path / "llama", "llama-tiny")  # what the e2e servers and the demo test run
    assert l3_counts.objects_per_page(llama) == 2
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    assert l3_counts.objects_per_page(str(tmp_path / "mla")) == 1
    with pytest.raises(ValueError, match="l3_objects_per_page"):
        l3_counts.objects_per_page(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="objects_per_page must be >= 1"):
        l3_counts.StoreCounter("x", objects_per_page=0)


@pytest.mark.parametrize("address, name", [
    ("local", "default"), ("local://e2e-x", "e2e-x"), ("inprocess://x", None), ("10.0.0.1:30001", None), (None, None),
])
def test_only_a_host_store_has_counters_another_process_reads(address, name):
    extra = {} if address is None else {"manager_address": address}
    assert l3_counts.host_store_name(extra) == name


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_without_a_host_store_pages_come_from_sglangs_metrics_or_a_clear_error(tmp_path):
    cluster = {"manager_address": "10.0.0.1:30001"}
    off = SGLangServer(ServerConfig(model_path="unused", extra_config=cluster), tmp_path, name="off")
    with pytest.raises(ServerError, match="no local store and metrics are off: give it a local store or enable_metrics"):
        off.l3_pages_stored()

    _Metrics.body = (b'# TYPE sglang:backup_pgs histogram\nsglang:backup_pgs_sum{tp_rank="0"} 12.0\n'
                     b'sglang:backup_pgs_count{tp_rank="0"} 3.0\nsglang:prefetch_pgs_sum{tp_rank="0"} 5.0\n')
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        on = SGLangServer(ServerConfig(model_path="unused", extra_config=cluster, enable_metrics=True),
                          tmp_path, name="on")
        on.port = httpd.server_address[1]
        assert (on.l3_pages_stored(), on.l3_pages_read()) == (12, 5)
    finally:
        httpd.shutdown()
        httpd.server_close()
