"""L3 as SGLang KV events, through real CPU servers, read by a subscriber
that decodes with SGLang's own classes (``sglang_simm_dev.kv_events_sub``).

Two servers of this module's own, started side by side and stopped when
it ends (as ``test_store_faults.py`` does):

* ``both``: SGLang's own stream (``--kv-events-config``, topic ``gpu``) and
  the plugin's (``kv_events``, topic ``l3``), with SGLang passing prefix
  keys (``hicache_storage_pass_prefix_keys``) so every parent is known;
* ``refused``: the plugin's stream on a store that refuses every put
  (``store_refusal.refusing_server``), SGLang's stream beside it.

A server without ``kv_events`` (SGLang's stream only) is the shared
``route-simm`` (``test_server.py::test_a_server_without_kv_events_publishes_nothing``).

What the store evicts or ``store clear`` removes, with no request of the
server's own in between, is announced through the local store's removals
(``Store.removed_since``, followed by the server): the module's last test.
"""

from __future__ import annotations

import json
import time

import pytest
from e2e_util import DEVICE_TOKENS, PAGE, prompt

from sglang_simm_dev.kv_events_sub import Subscriber, links
from sglang_simm_dev.sglang_server import ServerConfig, SGLangServer, free_port
from store_refusal import refusing_server

pytestmark = pytest.mark.e2e

#: see conftest.REQUEST_TIMEOUT_MS
REQUEST_TIMEOUT_MS = 10_000
PROMPT = 256


class Streams:
    """One server and a subscriber on each of its streams."""

    def __init__(self, server: SGLangServer, gpu: Subscriber, l3: Subscriber) -> None:
        self.server, self.gpu, self.l3 = server, gpu, l3

    def close(self) -> None:
        self.gpu.close()
        self.l3.close()


def _config(model: str, name: str, *, kv_events: dict, extra: dict | None = None,
            env: dict | None = None) -> tuple[ServerConfig, str]:
    gpu_endpoint = f"tcp://*:{free_port()}"
    sglang_events = {"publisher": "zmq", "endpoint": gpu_endpoint, "topic": "gpu"}
    store = {"manager_address": f"local://e2e-{name}", "request_timeout_ms": REQUEST_TIMEOUT_MS,
             "hicache_storage_pass_prefix_keys": True, "kv_events": kv_events, **(extra or {})}
    config = ServerConfig(model_path=model, route="simm", extra_config=store, page_size=PAGE,
                          max_total_tokens=DEVICE_TOKENS, sleep_on_idle=True, enable_metrics=True,
                          extra_args=("--kv-events-config", json.dumps(sglang_events)), env=env or {})
    return config, gpu_endpoint


@pytest.fixture(scope="module")
def streams(tiny_llama, tmp_path_factory):
    """name -> Streams, the two servers started side by side, each read
    from its start."""
    root = tmp_path_factory.mktemp("kv-events-servers")
    plans = {}
    for name, refused in (("both", False), ("refused", True)):
        l3_endpoint = f"tcp://*:{free_port()}"
        kv_events = {"publisher": "zmq", "endpoint": l3_endpoint, "topic": "l3"}
        extra, env = refusing_server({}, f"e2e-kv-events-{name}") if refused else (None, None)
        config, gpu_endpoint = _config(tiny_llama, f"kv-events-{name}", kv_events=kv_events, extra=extra, env=env)
        plans[name] = (SGLangServer(config, root / name, name=f"kv-events-{name}").launch(), gpu_endpoint,
                       l3_endpoint)
    out: dict[str, Streams] = {}
    try:
        for name, (server, gpu_endpoint, l3_endpoint) in plans.items():
            server.wait_ready()
            out[name] = Streams(server, Subscriber(gpu_endpoint, b"gpu"), Subscriber(l3_endpoint, b"l3"))
        time.sleep(0.5)  # ZMQ's slow joiner: subscriptions settle before any request
        yield out
    finally:
        for s in out.values():
            s.close()
        for server, _, _ in plans.values():
            server.stop()


def why(server: SGLangServer, what: str) -> str:
    return f"{what}; server log {server.log_path}:\n{server.log_tail(30)}"


def metric(server: SGLangServer, name: str, at_least: float = 0.0, timeout: float = 60.0) -> float:
    """``name`` in the server's /metrics (summed over labels) once it
    reaches ``at_least`` or ``timeout`` passes: the backend pushes its
    counters from SGLang's scheduler loop, at most every 0.5 s."""
    deadline = time.monotonic() + timeout
    while True:
        value = server.metrics().get(name, 0.0)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_every_page_announced_on_gpu_is_announced_on_l3_after_its_backup_with_sglangs_hashes(streams):
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    s = streams["both"]
    ids = prompt(381, PROMPT)
    s.server.generate(ids)
    gpu = lambda: links(s.gpu.events("BlockStored", medium="GPU"))  # noqa: E731
    l3 = lambda: links(s.l3.events("BlockStored", medium="EXTERNAL"))  # noqa: E731
    assert s.gpu.wait_for(lambda _: len(gpu()) >= PROMPT // PAGE, 60), why(s.server, "SGLang announced no GPU pages")
    assert s.l3.wait_for(lambda _: set(gpu()) <= set(l3()), 120), why(
        s.server, f"{len(set(gpu()) - set(l3()))} of {len(gpu())} GPU pages never announced on L3")
    want, got = gpu(), l3()
    assert {h: got[h] for h in want} == want, "an L3 page's parent differs from SGLang's"
    # and they are SGLang's page hashes of the prompt, one event a page
    prompt_pages = [hash_str_to_int64(k) for k in get_hash_str(ids[: PROMPT // PAGE * PAGE], None, PAGE)]
    assert set(prompt_pages) <= set(got)
    assert all(len(e.block_hashes) == 1 and e.token_ids == [] and e.block_size == PAGE
               for e in s.l3.events("BlockStored"))
    seqs = [r.seq for r in s.l3.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and {r.topic for r in s.l3.received} == {b"l3"}
    assert metric(s.server, "sglang_simm:kv_events_pages_total", len(want)) >= len(want)
    assert s.server.metrics().get("sglang_simm:kv_events_dropped_pages_total", -1) == 0


def test_a_namespaced_requests_pages_are_announced_one_event_per_page(streams):
    """SGLang announces an ``extra_key`` request's GPU pages under hashes of
    its own (its tokens, another seed); the backend knows its storage keys
    only, so each page is announced under the hash of its storage key."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64

    s = streams["both"]
    ids = prompt(382, PROMPT)
    s.server.generate(ids, extra_key="tenant-e2e")
    keys = get_storage_hash_str(RadixKey(ids[: PROMPT // PAGE * PAGE], extra_key="tenant-e2e"), page_size=PAGE)
    want = [hash_str_to_int64(k) for k in keys]

    def announced(sub):
        return [e for e in sub.events("BlockStored", medium="EXTERNAL") if set(e.block_hashes) & set(want)]

    assert s.l3.wait_for(lambda sub: len(announced(sub)) >= len(want), 120), why(
        s.server, f"{len(announced(s.l3))} of {len(want)} namespaced pages announced")
    events = announced(s.l3)
    assert sorted(h for e in events for h in e.block_hashes) == sorted(want)
    assert all(len(e.block_hashes) == 1 for e in events)
    assert not set(want) & set(links(s.gpu.events("BlockStored"))), "SGLang's own hashes are not the storage keys'"


def test_a_put_the_store_refused_announces_nothing(streams):
    s = streams["refused"]
    s.server.generate(prompt(383, PROMPT))
    assert s.gpu.wait_for(lambda sub: sub.events("BlockStored", medium="GPU"), 60), why(s.server, "no GPU pages")
    failed = metric(s.server, "sglang_simm:l3_pages_write_failed_total", 1, 120)
    assert failed >= 1, why(s.server, "no put reached the store")
    time.sleep(1.0)  # anything announced would be out by now
    metrics = s.server.metrics()
    assert metrics.get("sglang_simm:l3_pages_written_total", 0) == 0
    assert s.l3.received == [], [r.batch for r in s.l3.received]
    assert metrics.get("sglang_simm:kv_events_pages_total", -1) == 0


def test_what_the_store_evicts_and_what_a_clear_removes_is_announced_removed(streams):
    """Run last: it empties the server's store."""
    from sglang_simm.local_store.admin import open_running, store_dir

    s = streams["both"]
    s.server.generate(prompt(384, PROMPT))
    stored = lambda: set(links(s.l3.events("BlockStored", medium="EXTERNAL")))  # noqa: E731
    removed = lambda: {h for e in s.l3.events("BlockRemoved", medium="EXTERNAL") for h in e.block_hashes}  # noqa: E731
    assert s.l3.wait_for(lambda _: len(stored()) >= 3 * PROMPT // PAGE, 120), why(s.server, "too few L3 pages")
    assert not removed()
    handle = open_running(store_dir(), "e2e-kv-events-both")
    capacity = handle.capacity_bytes
    try:
        handle.set_capacity(handle.used_bytes // 2)  # the oldest half evicted, by the store alone
        kept = {page_hash(k) for k in handle.keys()}
        assert s.l3.wait_for(lambda _: removed() == stored() - kept, 30), why(
            s.server, f"{len(removed())} pages announced removed, {len(stored() - kept)} evicted")
        handle.admin("clear")
        assert s.l3.wait_for(lambda _: removed() == stored(), 30), why(s.server, "a clear left pages announced")
    finally:
        handle.set_capacity(capacity)
        handle.close()


def page_hash(object_key: str) -> int:
    """SGLang's event hash of the page an object of the store holds
    (``<namespace>/<page key>.<part>``)."""
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    return hash_str_to_int64(object_key.rsplit("/", 1)[-1].split(".", 1)[0])
