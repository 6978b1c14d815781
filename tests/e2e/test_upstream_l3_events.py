"""The SGLang change of docs/upstream-sglang-l3-events.md, tested before it
is proposed: a CPU server running SGLang 0.5.23 with the change applied at
import (``sglang_simm_dev.upstream_l3_events``), its Python tree core, and
SGLang's own ``file`` L3 backend (the change is SGLang's, for every
backend). SGLang's own stream must then announce every page it announced
on the GPU again on ``EXTERNAL`` once its backup is acknowledged, with the
same hashes and parents, for unsalted and namespaced requests alike.
"""

from __future__ import annotations

import json
import time

import pytest
from e2e_util import DEVICE_TOKENS, PAGE, prompt

from sglang_simm_dev.kv_events_sub import Subscriber, links
from sglang_simm_dev.sglang_server import ServerConfig, SGLangServer, free_port
from sglang_simm_dev.upstream_l3_events import write_site

pytestmark = pytest.mark.e2e

PROMPT = 256


@pytest.fixture(scope="module")
def changed(tiny_llama, tmp_path_factory):
    """(server, subscriber of SGLang's own stream), read from its start."""
    root = tmp_path_factory.mktemp("upstream-l3-events")
    endpoint = f"tcp://*:{free_port()}"
    config = ServerConfig(
        model_path=tiny_llama, route="file", extra_config={"file_storage_path": str(root / "l3")}, page_size=PAGE,
        max_total_tokens=DEVICE_TOKENS, sleep_on_idle=True, pythonpath=(write_site(root / "site"),),
        # the Rust tree core (0.5.23's default) needs the change's Rust half
        env={"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"},
        extra_args=("--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": endpoint})))
    server = SGLangServer(config, root / "server", name="upstream-l3-events").launch()
    sub = None
    try:
        server.wait_ready()
        sub = Subscriber(endpoint)
        time.sleep(0.5)  # ZMQ's slow joiner
        yield server, sub
    finally:
        if sub is not None:
            sub.close()
        server.stop()


@pytest.mark.parametrize("extra_key", [None, "tenant-upstream"], ids=["unsalted", "extra_key"])
def test_sglang_announces_every_backed_up_page_on_external_with_its_gpu_hash(changed, extra_key):
    server, sub = changed
    before = set(links(sub.events("BlockStored", medium="GPU")))
    server.generate(prompt(391 if extra_key is None else 392, PROMPT), extra_key=extra_key)

    def gpu():
        return {h: p for h, p in links(sub.events("BlockStored", medium="GPU")).items() if h not in before}

    def external():
        return links(sub.events("BlockStored", medium="EXTERNAL"))

    assert sub.wait_for(lambda _: len(gpu()) >= PROMPT // PAGE, 60), server.log_tail(30)
    assert sub.wait_for(lambda _: set(gpu()) <= set(external()), 120), (
        f"{len(set(gpu()) - set(external()))} of {len(gpu())} GPU pages never on EXTERNAL; "
        f"log {server.log_path}:\n{server.log_tail(30)}")
    want, got = gpu(), external()
    assert {h: got[h] for h in want} == want
    # SGLang's own events carry the tokens a storage backend never sees
    assert all(len(e.token_ids) == e.block_size * len(e.block_hashes)
               for e in sub.events("BlockStored", medium="EXTERNAL"))
