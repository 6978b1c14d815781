"""HiCache with this plugin as L3, through a real SGLang server on the CPU.

One server per route, shared by the module's tests:

* ``simm``: the plugin entry point, ``page_first`` host layout with the
  ``kernel`` io backend, ``--enable-metrics``, SGLang's own KV event stream
  (``--kv-events-config``) and not the plugin's (``kv_events``);
* ``dynamic``: module path and ``interface_v1``, ``page_first_direct`` with the
  ``direct`` io backend, metrics off (SGLang's default), a small local
  store (so the soak runs at its capacity, evicting), SGLang 0.5.23's
  ``buffer_only`` host mode (the host pool only stages transfers);

and ``l3-threshold``: the plugin entry point with a prefetch threshold above
every prompt the tests send, one cause that keeps L3 from hitting, for
``doctor --server`` to name. It writes into the ``corrupt-reads`` server's
store under a key namespace of its own, the cause "servers sharing a store
name their pages apart". ``doctor --server`` also meets its healthy and
metrics-off cases on the two routes, and ``dynamic``'s store full and
evicting; the backend's own /metrics series are checked on both routes.

Reference outputs are fresh computations: the same prompt sent before any
tier holds it, or under its own ``extra_key`` (which namespaces every tier).
A restored prompt must report its prefix from L3 (``cached_tokens_details``)
and give the same greedy tokens and the same logprobs, bit for bit.

The control (last in this file, on the ``corrupt-reads`` server): the same
restore with L3 returning corrupted pages must change the outputs, so the
restore tests can fail. Its store sets the local store client's
``local_store_corrupt_reads`` fault through ``client_flags``: the top bit of
every byte of every successful read is flipped after the copy, and the read
still reports success. Its warm-up round trip is off, since it would see the
bad bytes and refuse to start. It lives in this file so that a run spread
over pytest-xdist workers by file (scripts/test.sh) starts the four servers
once, on one worker.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from e2e_util import DEVICE_TOKENS, PAGE, TINY, matchable_tokens, prompt

from sglang_simm_dev.sglang_server import SGLangServer

pytestmark = pytest.mark.e2e

LONG = 1024


@pytest.fixture(scope="module", params=["dynamic", "simm"], ids=lambda r: f"route-{r}")
def server(request, servers) -> SGLangServer:
    """The route's server (conftest.SERVERS), shared by this module's tests."""
    return servers.get(f"route-{request.param}")


def why(server: SGLangServer, what: str) -> str:
    return f"{what}; server log {server.log_path}:\n{server.log_tail(30)}"


def backed_up(server: SGLangServer, generation, before: int) -> None:
    """Wait until the backup thread has written the request's pages to L3
    (whole pages of the input and output tokens but the last, which has no
    KV), then return."""
    pages = (generation.prompt_tokens + len(generation.output_ids) - 1) // PAGE
    server.wait_l3_stored(before + pages)


def assert_same_outputs(server, got, want, what: str) -> None:
    assert got.output_ids == want.output_ids, why(server, f"{what}: output ids differ")
    assert got.logprobs == want.logprobs, why(server, f"{what}: logprobs differ")


def test_log_shows_this_plugins_backend(server):
    log = server.log_text()
    route = server.config.route
    factory_line = "Creating dynamic storage backend" if route == "dynamic" else "Creating storage backend"
    assert f"{factory_line} 'simm' (sglang_simm.HiCacheSiMM)" in log, why(server, "factory line missing")
    assert "sglang-simm: bound MHATokenToKVPoolHost" in log, why(server, "the backend did not bind the host pool")
    assert f"({server.config.mem_layout}," in log.split("sglang-simm: bound MHATokenToKVPoolHost", 1)[1][:40]
    assert "sglang.srt.mem_cache.storage.simm" not in log, why(server, "SGLang's in-tree SiMM backend appears")
    assert "Traceback" not in log, why(server, "a traceback in the server log")


def test_restore_after_flush_hits_every_full_page(server):
    ids = prompt(1, LONG)
    stored = server.l3_pages_stored()
    fresh = server.generate(ids)
    assert fresh.cached_tokens == 0, why(server, "the first request already found a prefix")
    backed_up(server, fresh, stored)

    read = server.l3_pages_read()
    server.flush_cache()
    restored = server.generate(ids)
    want = matchable_tokens(LONG, PAGE)
    assert restored.cached_details is not None, why(server, "no cached_tokens_details")
    assert restored.storage_tokens == want, why(server, f"L3 hit {restored.cached_details}, expected {want} tokens")
    assert restored.device_tokens == 0 and restored.host_tokens == 0, restored.cached_details
    assert restored.cached_details.get("storage_backend") == "HiCacheSiMM"
    assert server.l3_pages_read() - read == want // PAGE, why(server, "the backend read other pages than the hit")
    assert_same_outputs(server, restored, fresh, "after a flush")


def test_buffer_only_host_mode_restores_from_l3(servers):
    """SGLang 0.5.23's ``--hicache-host-memory-mode buffer_only`` (the
    dynamic route's server): no host tier holds pages, so a flushed prompt
    comes back from L3 alone, with the outputs of its first computation."""
    server = servers.get("route-dynamic")
    assert "buffer_only" in server.log_text(), why(server, "the server is not in buffer_only mode")
    ids = prompt(7, LONG)
    stored = server.l3_pages_stored()
    fresh = server.generate(ids)
    backed_up(server, fresh, stored)
    server.flush_cache()
    restored = server.generate(ids)
    want = matchable_tokens(LONG, PAGE)
    assert restored.storage_tokens == want, why(server, f"L3 hit {restored.cached_details}, expected {want} tokens")
    assert restored.host_tokens == 0, restored.cached_details
    assert_same_outputs(server, restored, fresh, "buffer_only, restored from L3")
    assert "Traceback" not in server.log_text(), why(server, "a traceback in the server log")


def test_restore_after_eviction_under_load(server):
    ids = prompt(2, LONG)
    stored = server.l3_pages_stored()
    fresh = server.generate(ids)
    backed_up(server, fresh, stored)
    # Enough other prompts to push it out of the device pool and the host pool.
    fillers = (DEVICE_TOKENS * 3) // LONG + 2
    for seed in range(100, 100 + fillers):
        server.generate(prompt(seed, LONG), max_new_tokens=1)

    restored = server.generate(ids)
    want = matchable_tokens(LONG, PAGE)
    assert restored.device_tokens == 0 and restored.host_tokens == 0, why(
        server, f"still cached on the device or host: {restored.cached_details}"
    )
    assert restored.storage_tokens == want, why(server, f"L3 hit {restored.cached_details}, expected {want}")
    assert_same_outputs(server, restored, fresh, "after eviction")


def test_shared_prefix_gets_exactly_the_shared_pages(server):
    first = prompt(3, LONG)
    shared = 40 * PAGE
    second = first[:shared] + prompt(4, 300)
    stored = server.l3_pages_stored()
    done = server.generate(first, max_new_tokens=1)
    backed_up(server, done, stored)
    reference = server.generate(second, extra_key="fresh-reference")
    assert reference.cached_tokens == 0, reference.cached_details

    server.flush_cache()
    got = server.generate(second)
    assert got.storage_tokens == shared and got.cached_tokens == shared, why(
        server, f"L3 hit {got.cached_details}, expected exactly the {shared} shared tokens"
    )
    assert_same_outputs(server, got, reference, "with a shared prefix")


def test_metrics_count_backups_and_l3_hits(server):
    if not server.config.enable_metrics:
        pytest.skip("this route's server runs with metrics off (SGLang's default)")
    ids = prompt(5, LONG)
    before = server.metrics()
    stored = server.l3_pages_stored()
    fresh = server.generate(ids, max_new_tokens=1)
    backed_up(server, fresh, stored)
    server.flush_cache()
    server.generate(ids, max_new_tokens=1)
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("sglang:backuped_tokens_total") >= LONG
    assert delta("sglang:storage_prefetch_hit_tokens_total") == matchable_tokens(LONG, PAGE)
    assert delta("sglang:prefetched_tokens_total") == matchable_tokens(LONG, PAGE)


def scrape(server: SGLangServer) -> tuple[int, str]:
    """``/metrics`` as text, with its HTTP status (404 where metrics are off)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def test_plugin_series_in_metrics_only_with_the_flag(server):
    """With --enable-metrics the backend's own series reach the server's
    /metrics from its scheduler (SGLang's multiprocess files), labelled like
    SGLang's; without it there are none."""
    from sglang_simm.tools.doctor_server import metric_sum, parse_metrics

    ids = prompt(6, LONG)
    stored = server.l3_pages_stored()
    fresh = server.generate(ids, max_new_tokens=1)
    backed_up(server, fresh, stored)
    server.flush_cache()
    server.generate(ids, max_new_tokens=1)
    if not server.config.enable_metrics:
        status, text = scrape(server)
        assert "sglang_simm:" not in text, text[:500]
        return
    # the backend flushes its counters from the scheduler loop at most every 0.5 s
    deadline = time.monotonic() + 30
    while True:
        status, text = scrape(server)
        parsed = parse_metrics(text)
        if (metric_sum(parsed, "sglang_simm:l3_pages_hit_total") or 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200
    for name in ("sglang_simm:l3_pages_hit_total", "sglang_simm:l3_pages_written_total",
                 "sglang_simm:l3_exists_calls_total"):
        assert (metric_sum(parsed, name) or 0) > 0, why(server, f"{name} has no samples: {sorted(parsed)[:80]}")
    assert (metric_sum(parsed, "sglang_simm:l3_call_seconds_count", op="get") or 0) > 0
    assert (metric_sum(parsed, "sglang_simm:l3_call_seconds_count", op="set") or 0) > 0
    labels, _ = parsed["sglang_simm:l3_pages_hit_total"][0]
    assert labels["tp_rank"] == "0" and labels["model_name"], labels
    # which store L3 is: the session's store directory, exported to the servers (tests/suite.py)
    [(store, one)] = parsed["sglang_simm:l3_store_info"]
    assert one == 1 and store["address"] == server.config.extra_config["manager_address"], store
    assert (store["store_dir"], store["store_dir_from"]) == (os.environ["SGLANG_SIMM_STORE_DIR"],
                                                             "env SGLANG_SIMM_STORE_DIR"), store
    assert f"lives in {store['store_dir']} (env SGLANG_SIMM_STORE_DIR)" in server.log_text()
    print("\n".join(line for line in text.splitlines() if line.startswith("sglang_simm:l3_pages")))


def test_a_server_without_kv_events_publishes_nothing(servers):
    """``route-simm`` runs SGLang's own KV event stream and not the plugin's:
    its L3 backups are announced nowhere (no medium below the host tier on
    SGLang's stream, no socket, no series, no log line of the plugin's)."""
    from sglang_simm_dev.kv_events_sub import Subscriber

    server = servers.get("route-simm")
    config = json.loads(server.config.extra_args[server.config.extra_args.index("--kv-events-config") + 1])
    sub = Subscriber(config["endpoint"], b"gpu")
    try:
        time.sleep(0.5)  # ZMQ's slow joiner
        ids = prompt(11, LONG)
        stored = server.l3_pages_stored()
        backed_up(server, server.generate(ids), stored)
        assert sub.wait_for(lambda s: s.events("BlockStored", medium="GPU"), 30), why(server, "SGLang announced nothing")
        time.sleep(1.0)
        media = {getattr(e, "medium", None) for e in sub.events()}
        assert not media & {"EXTERNAL", "DISK"}, media
    finally:
        sub.close()
    assert "sglang-simm kv_events" not in server.log_text()
    assert not [line for line in scrape(server)[1].splitlines() if line.startswith("sglang_simm:kv_events")]


def test_doctor_server_names_what_it_reads(server, capsys):
    from sglang_simm.tools.cli import main

    rc = main(["doctor", "--server", server.url])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "write policy write_through" in out
    if server.config.enable_metrics:
        assert "pages hit" in out and "metrics are off" not in out, out
    else:
        assert "SGLang's metrics are off" in out and "--enable-metrics" in out, out
    # its local store is running and holds one namespace of pages
    assert "under one namespace" in out, out


def test_doctor_server_names_a_threshold_above_the_prompts(servers, capsys):
    """The server's prefetch threshold (extra config) exceeds every prompt
    it serves: L3 is never asked, and doctor says so, exit status 1."""
    from sglang_simm.tools.cli import main

    server = servers.get("l3-threshold")
    stored = server.l3_pages_stored()
    # its backup waited for: its store is corrupt-reads's too, whose test counts the pages it writes there
    backed_up(server, server.generate(prompt(7, 400), max_new_tokens=1), stored)
    deadline = time.monotonic() + 30
    while True:  # SGLang's own counters reach /metrics from its tokenizer process
        rc = main(["doctor", "--server", server.url])
        out = capsys.readouterr().out
        if rc == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(out)
    assert rc == 1, out
    assert "the prefetch threshold is 4096 tokens and the prompts served so far average" in out, out
    assert '"prefetch_threshold": N' in out
    # the plugin's series are there from its attach, at 0 before any L3 call
    assert "in-tree HiCacheSiMM" not in out, out


def test_doctor_server_names_servers_sharing_a_store_under_other_namespaces(servers, capsys):
    """Two real servers write into one local store, their pages named apart:
    ``l3-threshold`` (extra_backend_tag "threshold") joins ``corrupt-reads``'s
    store (conftest.SERVERS). Doctor, given both, names the store's two key
    namespaces and the field the servers differ in; given a server alone on
    its store (``route-simm``), neither.

    Why these two: no fifth server (five CPU servers leave too little host
    memory for SGLang's reserve), and neither disturbs the other's tests.
    ``l3-threshold``'s tests count no pages and never read L3 (threshold);
    ``corrupt-reads`` counts its pages from a reading of the shared counters
    taken just before its request, and every request ``l3-threshold`` gets
    has its backup waited for, so none lands inside that count. The routes'
    stores stay their own: their doctor test checks each holds one
    namespace. Corrupted reads are a fault of ``corrupt-reads``'s own
    client, so what ``l3-threshold`` reads (its warm-up round trip) is true."""
    from sglang_simm.tools.cli import main

    tagged, plain = servers.get("l3-threshold"), servers.get("corrupt-reads")
    stored = tagged.l3_pages_stored()  # one store: both servers' pages count here
    written = [server.generate(prompt(seed, 320), max_new_tokens=1) for server, seed in ((tagged, 8), (plain, 9))]
    tagged.wait_l3_stored(stored + sum((g.prompt_tokens + len(g.output_ids) - 1) // PAGE for g in written))

    main(["doctor", "--server", tagged.url, "--server", plain.url])
    out = " ".join(capsys.readouterr().out.split())
    assert "'e2e-corrupt-reads' holds pages under 2 key namespaces" in out, out
    assert "threshold/s1." in out, out
    apart = out.split("name their pages apart", 1)
    assert len(apart) == 2, out
    assert "extra_backend_tag:" in apart[1] and f"{tagged.url} 'threshold'" in apart[1], out
    # the tag is the one field they differ in
    assert "hicache_mem_layout" not in apart[1] and "page_size" not in apart[1], out

    single = servers.get("route-simm")
    stored = single.l3_pages_stored()
    backed_up(single, single.generate(prompt(9, 320), max_new_tokens=1), stored)  # its store holds pages
    main(["doctor", "--server", single.url])
    alone = " ".join(capsys.readouterr().out.split())
    assert "under one namespace" in alone and "key namespaces" not in alone, alone
    assert "name their pages apart" not in alone, alone
    print(out)


def test_soak_keeps_scheduler_memory_flat(server):
    """Metrics off (SGLang's default): nothing drains the backend's per-batch
    records, so growth there would show in the scheduler's private memory
    (RssAnon; the local store's objects live in shared memory, RssShmem). The
    store is filled to its capacity first (it then evicts and reuses memory),
    and a first stretch of traffic settles the allocator before the baseline."""
    if server.config.enable_metrics:
        pytest.skip("the soak runs on the server with metrics off (SGLang's default)")
    schedulers = server.scheduler_pids()
    length = 320  # SGLang prefetches from L3 only from 256 matched tokens on
    seed = 10_000
    recent: list[list[int]] = []

    def traffic(rounds: int) -> tuple[int, int]:
        """Per round: 5 new prompts (L3 writes, store evictions), a flush,
        then 3 of them again (L3 reads)."""
        nonlocal seed
        requests = hits = 0
        for _ in range(rounds):
            stored = server.l3_pages_stored()
            for _ in range(5):
                ids = prompt(seed, length)
                seed += 1
                server.generate(ids, max_new_tokens=2)
                recent.append(ids)
                requests += 1
            server.wait_l3_stored(stored + 5 * ((length + 1) // PAGE))  # a flush drops pending backups
            server.flush_cache()
            for ids in recent[-3:]:
                hits += server.generate(ids, max_new_tokens=2).storage_tokens > 0
                requests += 1
            del recent[:-3]
        return requests, hits

    fill = fill_until_it_evicts(server)
    settle, _ = traffic(12)
    start_rss = server.scheduler_rss_bytes()
    requests, hits = traffic(24)
    end_rss = server.scheduler_rss_bytes()
    growth = end_rss - start_rss
    print(
        f"soak: {requests} requests ({hits} L3 hits) after {fill + settle} to fill the store and settle; "
        f"scheduler private memory {start_rss / 2**20:.1f} -> {end_rss / 2**20:.1f} MiB "
        f"({growth / 2**20:+.1f} MiB)"
    )
    assert server.scheduler_pids() == schedulers, "a scheduler process was replaced"
    assert hits == 3 * 24, why(server, f"only {hits} of the {3 * 24} re-sent prompts hit L3")
    assert growth < 16 << 20, why(
        server, f"the scheduler's private memory grew {growth / 2**20:.1f} MiB over {requests} requests")


def fill_until_it_evicts(server: SGLangServer) -> int:
    """Send new prompts until the server's local store has evicted (it is
    then full); the requests sent, 0 where it already had. Bounded by
    twice the prompts that fill its capacity."""
    counter = server.l3_counter()
    status = counter.status()
    prompt_bytes = (LONG // PAGE) * PAGE * TINY.kv_bytes_per_token()
    most = 2 * int(status["capacity_bytes"]) // prompt_bytes + 2
    sent = 0
    while not int(status["evictions"]):
        assert sent < most, why(server, f"{sent} prompts of {LONG} tokens and its store has not evicted: {status}")
        stored = server.l3_pages_stored()
        backed_up(server, server.generate(prompt(20_000 + sent, LONG), max_new_tokens=1), stored)
        sent += 1
        status = counter.status()
    return sent


def test_doctor_server_names_a_full_evicting_store(servers, capsys):
    """``route-dynamic``'s 32 MiB store, filled until it evicts (its soak
    fills it too; whichever test runs first pays for it): doctor names the
    store full, its evictions, and the setting that sizes it. The control:
    ``route-simm``'s store, far from full, is not named so."""
    from sglang_simm.tools.cli import main

    server = servers.get("route-dynamic")
    fill_until_it_evicts(server)
    rc = main(["doctor", "--server", server.url])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out  # a warning: L3 still hits, on what is left
    assert "the local store 'e2e-route-dynamic' is full (" in out and "and has evicted" in out, out
    assert '"local_store_capacity_bytes" in the extra config' in out, out

    main(["doctor", "--server", servers.get("route-simm").url])
    healthy = " ".join(capsys.readouterr().out.split())
    assert "is full" not in healthy and "has evicted" not in healthy, healthy
    print(out)


# -- the control -------------------------------------------------------------------------


def test_corrupted_l3_pages_change_the_outputs(servers):
    server = servers.get("corrupt-reads")
    ids = prompt(1, LONG)
    stored = server.l3_pages_stored()  # its store holds l3-threshold's pages too
    fresh = server.generate(ids)
    backed_up(server, fresh, stored)
    server.flush_cache()
    restored = server.generate(ids)
    # the corrupted pages were served as an L3 hit ...
    assert restored.storage_tokens == matchable_tokens(LONG, PAGE), restored.cached_details
    # ... and the model computed with them
    assert restored.logprobs != fresh.logprobs, f"corrupted KV gave the same logprobs; log {server.log_path}"
    assert restored.output_ids != fresh.output_ids, f"corrupted KV gave the same tokens; log {server.log_path}"
