"""The control: the same restore with L3 returning corrupted pages must
change the outputs, so the restore tests can fail.

The server (conftest.SERVERS["corrupt-reads"]) sets the embedded store's
``embedded_corrupt_reads`` fault through ``client_flags``: the top bit of
every byte of every successful read is flipped after the copy, and the read
still reports success. Its warm-up round trip is off, since it would see the
bad bytes and refuse to start.
"""

from __future__ import annotations

import pytest
from e2e_util import PAGE, matchable_tokens, prompt

pytestmark = pytest.mark.e2e

LONG = 1024


def test_corrupted_l3_pages_change_the_outputs(servers):
    server = servers.get("corrupt-reads")
    ids = prompt(1, LONG)
    fresh = server.generate(ids)
    server.wait_l3_stored((LONG + len(fresh.output_ids) - 1) // PAGE)  # the last token has no KV
    server.flush_cache()
    restored = server.generate(ids)
    # the corrupted pages were served as an L3 hit ...
    assert restored.storage_tokens == matchable_tokens(LONG, PAGE), restored.cached_details
    # ... and the model computed with them
    assert restored.logprobs != fresh.logprobs, f"corrupted KV gave the same logprobs; log {server.log_path}"
    assert restored.output_ids != fresh.output_ids, f"corrupted KV gave the same tokens; log {server.log_path}"
