"""L3 pages announced as SGLang KV events (``kv_events``): what is announced,
under which hash, and that no subscriber or full queue reaches the data path.

Backends come from SGLang's storage factory over real host pools and a
local store; events are read back off a real ZMQ socket and decoded with
SGLang's own classes (``sglang_simm_dev.kv_events_sub``). Hashes are held to
SGLang's own: its ``KVCacheEventRecorder`` announcing the same radix nodes,
and its ``get_storage_hash_str`` naming the same pages.
"""

from __future__ import annotations

import threading
import time

import pytest
from pages import fill_random, hashes, slots, tiny
from sglang_simm.config import SiMMConfig
from sglang_simm.events import MAX_BATCH_PAGES, NO_EVENTS, L3Events, event_hash
from sglang_simm.events_config import DEFAULT_ENDPOINT, KVEventsSettings, parse_kv_events
from sglang_simm.events_publisher import medium_of, publisher_slot
from sglang_simm.simm_rules import OK
from sglang_simm.local_store.admin import medium_of as store_medium
from sglang_simm_dev.kv_events_sub import StalledSubscriber, Subscriber, links, replay
from sglang_simm_dev.sglang_server import free_port
from polling import until
from store_refusal import refused_puts


def list_links(events) -> list[tuple[int, int | None]]:
    return list(links(events).items())


def removed(events) -> list[int]:
    return [h for e in events for h in e.block_hashes]


@pytest.fixture
def stream(attach):
    """``stream(geom=tiny(), **kv_events)`` -> (backend, host pool, subscriber):
    a backend announcing on a free TCP port (``tcp://*:PORT``, which binds),
    read by a subscriber that is connected before anything is published."""
    subscribers = []

    def _stream(geom=None, *, extra=None, **settings):
        endpoint = f"tcp://*:{free_port()}"
        kv_events = {"publisher": "zmq", "endpoint": endpoint, **settings}
        backend, host = attach(geom or tiny(), extra={"kv_events": kv_events, **(extra or {})})
        sub = Subscriber(endpoint)
        subscribers.append(sub)
        time.sleep(0.3)  # ZMQ's slow joiner: a SUB misses what is sent before it is connected
        fill_random(host, seed=3)
        return backend, host, sub

    yield _stream
    for sub in subscribers:
        sub.close()


def flushed(backend) -> None:
    assert backend.events.flush(), "the events were not published"


# ------------------------------------------------------------------ settings


def test_kv_events_is_off_by_default_and_off_publishes_nothing(attach):
    backend, _ = attach(tiny())
    assert SiMMConfig(manager_address="local").kv_events is None
    assert backend.events is NO_EVENTS and "kv_events" not in backend.stats()
    null, _ = attach(tiny(), extra={"kv_events": {"publisher": "null", "endpoint": f"tcp://*:{free_port()}"}})
    assert null.events is NO_EVENTS


def test_kv_events_takes_sglangs_keys_and_json_text():
    text = '{"publisher": "zmq", "endpoint": "tcp://*:6001", "replay_endpoint": "tcp://*:6002", "topic": "l3", ' \
           '"hwm": 5, "buffer_steps": 7, "max_queue_size": 9, "format": "dynamo", "bind": true}'
    got = parse_kv_events(text)
    assert got == KVEventsSettings(publisher="zmq", endpoint="tcp://*:6001", replay_endpoint="tcp://*:6002",
                                   topic="l3", hwm=5, buffer_steps=7, max_queue_size=9, format="dynamo", bind=True)
    sglang = got.sglang_config(inner_queue=3)
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    # every key handed on is one SGLang's own config reads, with our values
    assert KVEventsConfig.model_validate(sglang).model_dump() == {**sglang}
    assert parse_kv_events({"publisher": "zmq"}).endpoint == DEFAULT_ENDPOINT != KVEventsConfig().endpoint
    assert parse_kv_events(None) is None and parse_kv_events("") is None


@pytest.mark.parametrize("value, says", [
    ({"publisher": "zmq", "endpont": "tcp://*:1"}, "unknown key 'endpont' (did you mean 'endpoint'?)"),
    ({"publisher": "kafka"}, "publisher='kafka'"),
    ({"publisher": "zmq", "endpoint": "http://x:1"}, "not a ZeroMQ address"),
    ({"publisher": "zmq", "endpoint": "tcp://*:99999"}, "no port in 1..65535"),
    ({"publisher": "zmq", "medium": "GPU"}, "'auto' or 'EXTERNAL' or 'DISK'"),
    ({"publisher": "zmq", "max_queue_size": 0}, "max_queue_size=0"),
    ("[1]", "is not an object"),
], ids=["typo", "publisher", "scheme", "port", "medium", "queue", "not-object"])
def test_a_wrong_kv_events_value_stops_the_start_naming_key_value_and_fix(value, says):
    with pytest.raises(ValueError) as err:
        SiMMConfig.from_mapping({"manager_address": "local", "kv_events": value}, source="extra_config")
    text = str(err.value)
    assert "kv_events=" in text and "(from extra_config)" in text and says in text and "accepted:" in text


# -------------------------------------------------------- hashes: SGLang's own


def _nodes(tokens_a, tokens_b, **namespace):
    """Two radix nodes, ``b`` below ``a`` below the root, as SGLang's tree
    holds them (page hashes filled in by SGLang on first use)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    root = TreeNode()
    root.key, root.hash_value = RadixKey([]), []
    a, b = TreeNode(), TreeNode()
    a.parent, a.key = root, RadixKey(tokens_a, **namespace)
    b.parent, b.key = a, RadixKey(tokens_b, **namespace)
    return a, b


def _sglang_gpu_events(page_size, *nodes):
    """What SGLang's own recorder announces for ``nodes`` (the GPU tier);
    sets each node's ``hash_value``, the page keys SGLang backs up."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    recorder = KVCacheEventRecorder(enabled=True, page_size=page_size)
    for node in nodes:
        recorder.record_store(node)
    return recorder.take()


def _back_up(backend, host, a, b):
    """The two nodes backed up as SGLang's controller does: the keys
    ``node.hash_value``, the prefix keys of the pages before them."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    na, nb = len(a.hash_value), len(b.hash_value)
    assert all(backend.batch_set_v1(a.hash_value, slots(host, 0, na), HiCacheStorageExtraInfo(prefix_keys=[])))
    # b in two batches, as a node past STORAGE_BATCH_SIZE pages is
    first = HiCacheStorageExtraInfo(prefix_keys=list(a.hash_value))
    assert all(backend.batch_set_v1(b.hash_value[:1], slots(host, na, 1), first))
    rest = HiCacheStorageExtraInfo(prefix_keys=list(a.hash_value) + b.hash_value[:1])
    assert all(backend.batch_set_v1(b.hash_value[1:], slots(host, na + 1, nb - 1), rest))
    flushed(backend)


def test_an_unsalted_prompts_pages_carry_sglangs_own_event_hashes_and_parents(stream):
    backend, host, sub = stream()
    ps = host.page_size
    a, b = _nodes(list(range(100, 100 + 4 * ps)), list(range(200, 200 + 3 * ps)))
    gpu = _sglang_gpu_events(ps, a, b)
    _back_up(backend, host, a, b)
    assert sub.wait_for(lambda s: len(s.events("BlockStored")) == 7, 10)
    ours = sub.events("BlockStored", medium="EXTERNAL")
    assert list_links(ours) == list_links(gpu) and len(list_links(gpu)) == 7
    assert all(len(e.block_hashes) == 1 and e.token_ids == [] and e.block_size == ps for e in ours)
    assert {type(e).__name__ for e in gpu} == {"BlockStored"} and gpu[0].medium in (None, "GPU")


@pytest.mark.parametrize("namespace", [{"extra_key": "tenant-a"}, {"cache_salt": "salt-b"}],
                         ids=["extra_key", "cache_salt"])
def test_a_namespaced_requests_pages_are_announced_one_event_each_under_their_storage_hashes(stream, namespace):
    """SGLang hashes a namespaced node's events from its tokens with another
    seed than its storage keys (which the backend receives), so they differ:
    each page is announced under the hash of its storage key, which a
    consumer finds by hashing the request as ``get_storage_hash_str`` does."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64

    backend, host, sub = stream()
    ps = host.page_size
    tokens_a, tokens_b = list(range(300, 300 + 4 * ps)), list(range(400, 400 + 3 * ps))
    a, b = _nodes(tokens_a, tokens_b, **namespace)
    gpu = _sglang_gpu_events(ps, a, b)
    _back_up(backend, host, a, b)
    assert sub.wait_for(lambda s: len(s.events("BlockStored")) == 7, 10)
    ours = sub.events("BlockStored")
    storage = get_storage_hash_str(RadixKey(tokens_a + tokens_b, **namespace), page_size=ps)
    assert a.hash_value + b.hash_value == storage  # the keys SGLang hands the backend
    assert [e.block_hashes for e in ours] == [[hash_str_to_int64(k)] for k in storage]
    assert [p for _, p in list_links(ours)].count(None) == 1 and list_links(ours)[0][1] is None  # one chain
    assert not {h for h, _ in list_links(ours)} & {h for h, _ in list_links(gpu)}


def test_event_hash_is_sglangs_hash_str_to_int64():
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    keys = hashes(2000, "event-hash") + ["f" * 64, "8" + "0" * 63, "7" + "f" * 63, "0" * 64]
    assert [event_hash(k) for k in keys] == [hash_str_to_int64(k) for k in keys]
    assert {event_hash(k) < 0 for k in keys} == {True, False}


# ----------------------------------------------------- what is (not) announced


def test_a_put_the_store_refused_announces_nothing(stream, store_name):
    backend, host, sub = stream()
    with refused_puts(store_name):
        assert backend.batch_set_v1(hashes(3, "refused"), slots(host, 0, 3)) == [False] * 3
    assert backend.batch_set_v1(hashes(2, "kept"), slots(host, 4, 2)) == [True] * 2
    flushed(backend)
    assert sub.wait_for(lambda s: len(s.events("BlockStored")) == 2, 10)
    time.sleep(0.2)
    assert not sub.events("BlockRemoved") and list_links(sub.events("BlockStored")) == [
        (event_hash(k), p) for k, p in zip(hashes(2, "kept"), [None, event_hash(hashes(2, "kept")[0])])]
    assert backend.stats()["pages_write_failed"] == 3


def test_only_the_leading_run_of_stored_pages_is_announced(stream):
    """SGLang stops a backup at its first failed page: pages after a gap
    are unreachable by a prefix match, so they are not announced."""
    backend, host, sub = stream()
    keys = hashes(4, "gap")
    keys[2] = "not a page key of SGLang's, far too long to fit any key budget " * 8  # refused: misses
    assert backend.batch_set_v1(keys, slots(host, 0, 4)) == [True, True, False, True]
    flushed(backend)
    assert sub.wait_for(lambda s: len(s.events("BlockStored")) >= 2, 10)
    time.sleep(0.2)
    assert [h for h, _ in list_links(sub.events("BlockStored"))] == [event_hash(k) for k in keys[:2]]


def test_a_lookup_or_read_that_misses_an_announced_page_announces_its_removal(stream):
    backend, host, sub = stream()
    keys = hashes(4, "gone")
    assert all(backend.batch_set_v1(keys, slots(host, 0, 4)))
    flushed(backend)  # announced (and remembered) before they go
    kv = backend.pools.kv
    # pages 1 and 3 leave the store behind the backend's back (SiMM evicts and says nothing)
    for k in (keys[1], keys[3]):
        for obj in kv.suffixes:
            backend.client.delete(kv.prefix + k + obj)
    never = hashes(2, "never-announced")
    assert backend.batch_exists(keys + never) == 1
    flushed(backend)
    assert sub.wait_for(lambda s: s.events("BlockRemoved"), 10)
    assert removed(sub.events("BlockRemoved", medium="EXTERNAL")) == [event_hash(keys[1]), event_hash(keys[3])]
    # a read that misses a page announced again
    assert all(backend.batch_set_v1(keys[1:2], slots(host, 1, 1)))
    flushed(backend)
    for obj in kv.suffixes:
        backend.client.delete(kv.prefix + keys[1] + obj)
    assert backend.batch_get_v1(keys[:2], slots(host, 8, 2)) == [True, False]
    flushed(backend)
    assert sub.wait_for(lambda s: len(removed(s.events("BlockRemoved"))) == 3, 10)
    assert removed(sub.events("BlockRemoved"))[-1] == event_hash(keys[1])


def test_what_the_store_says_it_removed_or_cleared_is_announced_for_this_backends_pages_only(stream):
    backend, host, sub = stream()
    keys = hashes(3, "store-said")
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    kv = backend.pools.kv
    foreign = ["other-ns/" + keys[0] + ".k", "sglang_simm_warmup_x"]
    backend.l3_removed([kv.prefix + keys[0] + s for s in kv.suffixes] + foreign)
    flushed(backend)
    assert sub.wait_for(lambda s: s.events("BlockRemoved"), 10)
    assert removed(sub.events("BlockRemoved")) == [event_hash(keys[0])]
    backend.l3_cleared("other-namespace/")  # not ours: nothing
    backend.l3_cleared("")
    flushed(backend)
    assert sub.wait_for(lambda s: len(removed(s.events("BlockRemoved"))) == 3, 10)
    assert removed(sub.events("BlockRemoved"))[1:] == [event_hash(k) for k in keys[1:]]
    assert backend.stats()["kv_events"]["remembered_pages"] == 0


def test_what_another_client_removes_from_the_shared_store_is_announced(stream, store_name):
    """The local store's own removals reach the server that announced the
    pages, whoever made them leave: another client's delete, then a
    ``store clear`` (``removal_feed``, no call of this backend in between)."""
    from sglang_simm.local_store import get_server

    backend, host, sub = stream()
    keys = hashes(3, "shared")
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    flushed(backend)
    assert sub.wait_for(lambda s: len(s.events("BlockStored")) == 3, 10)
    other = get_server(store_name)  # this process's handle: a client of the same store process
    kv = backend.pools.kv
    assert other.delete(kv.prefix + keys[0] + kv.suffixes[0]) == OK
    assert sub.wait_for(lambda s: removed(s.events("BlockRemoved")) == [event_hash(keys[0])], 10)
    other.admin("clear")
    assert sub.wait_for(lambda s: sorted(removed(s.events("BlockRemoved"))) == sorted(map(event_hash, keys)), 10)


def test_clear_and_close_announce_every_remembered_page_removed_and_free_the_port(stream, attach):
    backend, host, sub = stream()
    keys = hashes(5, "clear-close")
    assert all(backend.batch_set_v1(keys[:3], slots(host, 0, 3)))
    flushed(backend)
    backend.clear()  # SGLang's storage clear: the local store deletes the namespace
    assert backend.batch_exists(keys[:3]) == 0
    flushed(backend)
    assert sub.wait_for(lambda s: len(removed(s.events("BlockRemoved"))) == 3, 10)
    assert sorted(removed(sub.events("BlockRemoved"))) == sorted(map(event_hash, keys[:3]))
    assert all(backend.batch_set_v1(keys[3:], slots(host, 3, 2)))
    flushed(backend)
    endpoint = backend.config.kv_events.endpoint
    backend.close()
    assert sub.wait_for(lambda s: len(removed(s.events("BlockRemoved"))) == 5, 10)
    assert removed(sub.events("BlockRemoved"))[3:] == [event_hash(k) for k in keys[3:]]
    # SGLang detaches and attaches again: the new backend binds the same port
    again, _ = attach(tiny(), extra={"kv_events": {"publisher": "zmq", "endpoint": endpoint}})
    assert again.events.on


def test_past_remember_pages_the_oldest_is_announced_removed(stream):
    backend, host, sub = stream(remember_pages=2)
    keys = hashes(3, "remember")
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    flushed(backend)
    assert sub.wait_for(lambda s: s.events("BlockRemoved"), 10)
    assert removed(sub.events("BlockRemoved")) == [event_hash(keys[0])]
    assert backend.stats()["kv_events"]["remembered_pages"] == 2


def test_replay_serves_the_batches_a_subscriber_missed_as_sglang_does(stream):
    replay_endpoint = f"tcp://*:{free_port()}"
    backend, host, sub = stream(replay_endpoint=replay_endpoint, buffer_steps=8)
    for i in range(3):
        assert all(backend.batch_set_v1(hashes(1, f"replay{i}"), slots(host, i, 1)))
        flushed(backend)
    assert sub.wait_for(lambda s: len(s.received) == 3, 10)
    got = replay(replay_endpoint, 1)
    assert [r.seq for r in got] == [1, 2] == [r.seq for r in sub.received[1:]]
    assert [r.batch.events for r in got] == [r.batch.events for r in sub.received[1:]]


# ------------------------------------------------------ never on the request path


def test_an_event_that_fails_never_changes_what_the_backend_answers(stream, monkeypatch):
    backend, host, _ = stream()
    keys = hashes(3, "answers")
    assert all(backend.batch_set_v1(keys, slots(host, 0, 3)))
    flushed(backend)

    def broken(*args, **kwargs):
        raise RuntimeError("an event that cannot be queued")

    monkeypatch.setattr(backend.events, "_put", broken)
    assert backend.batch_set_v1(hashes(2, "more"), slots(host, 3, 2)) == [True, True]
    for obj in backend.pools.kv.suffixes:
        backend.client.delete(backend.pools.kv.prefix + keys[1] + obj)
    assert backend.batch_exists(keys) == 1  # a miss of a remembered page, whose event fails
    assert backend.stats()["errors"] == {}


class _StuckPublisher:
    """SGLang's publisher with its queue full: ``publish`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches = []

    def publish(self, batch) -> None:
        self.release.wait()
        self.batches.append(batch)

    def shutdown(self) -> None:
        self.release.set()


def test_a_full_queue_drops_and_counts_while_the_data_path_goes_on():
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stuck = _StuckPublisher()
    events = L3Events(stuck, medium=StorageMedium.EXTERNAL, max_queue_pages=10, remember_pages=100)
    try:
        events.stored(hashes(4, "a"), [True] * 4, None, 16)  # taken by the thread, which then blocks
        until(lambda: events.snapshot()["queued_pages"] == 0, "the thread to take the first item")
        for i in range(6):
            events.stored(hashes(4, f"b{i}"), [True] * 4, None, 16)
        snap = events.snapshot()
        assert snap["queued_pages"] == 8 and snap["dropped_pages"]["stored"] == 16
        stuck.release.set()
        assert events.flush()
        assert [len(b.events) for b in stuck.batches] == [4, 8]
        assert events.snapshot()["stored_pages"] == 12
    finally:
        events.close()


def test_batches_hold_at_most_max_batch_pages():
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stuck = _StuckPublisher()
    stuck.release.set()
    events = L3Events(stuck, medium=StorageMedium.EXTERNAL, max_queue_pages=10 * MAX_BATCH_PAGES, remember_pages=0)
    half = MAX_BATCH_PAGES // 2
    try:
        with events._cond:  # the thread takes nothing until all five are queued
            for i in range(5):
                events.stored(hashes(half, f"c{i}"), [True] * half, None, 16)
        assert events.flush()
        assert [len(b.events) for b in stuck.batches] == [MAX_BATCH_PAGES, MAX_BATCH_PAGES, half]
    finally:
        events.close()


def test_a_subscriber_that_stops_reading_or_dies_costs_the_data_path_nothing(stream):
    """A stalled subscriber: ZMQ keeps ``hwm`` batches for it, then drops
    them, and the publisher goes on; a dead one leaves nothing behind. Every
    call returns, every batch is handed on, nothing is dropped by us."""
    backend, host, sub = stream(hwm=2, remember_pages=0)
    endpoint = backend.config.kv_events.endpoint
    stalled = StalledSubscriber(endpoint, rcvhwm=1)
    dead = StalledSubscriber(endpoint)
    time.sleep(0.3)
    dead.close()
    try:
        for i in range(200):
            assert all(backend.batch_set_v1(hashes(4, f"s{i}"), slots(host, 0, 4)))
            flushed(backend)  # one batch each: far past the stalled subscriber's high-water mark
        snap = backend.stats()["kv_events"]
        assert snap["stored_pages"] == 800 and snap["batches"] == 200
        assert snap["dropped_pages"] == {"stored": 0, "removed": 0}
        # the stream goes on for those who read (the reader may lag and lose
        # batches past the same high-water mark, so a page goes out until one arrives)
        after = iter(hashes(100, "after the stall"))

        def one_more_arrived() -> bool:
            key = next(after)
            assert all(backend.batch_set_v1([key], slots(host, 5, 1)))
            return sub.wait_for(lambda s: any(e.block_hashes == [event_hash(key)] for e in s.events("BlockStored")), 0.5)

        until(one_more_arrived, "a page stored after the stall to reach the reading subscriber", timeout=30)
    finally:
        stalled.close()


# ------------------------------------------------------------- who publishes


@pytest.mark.parametrize("fields, slot", [
    ({}, 0), ({"dp_rank": 2}, 2), ({"tp_rank": 1}, None), ({"pp_rank": 1}, None), ({"attn_cp_rank": 1}, None),
], ids=["rank0", "dp2", "tp1", "pp1", "cp1"])
def test_one_publisher_per_server_on_its_dp_port(fields, slot):
    from sglang_simm_dev.pools import storage_config

    assert publisher_slot(storage_config(**fields)) == slot


def test_a_non_publishing_rank_opens_no_socket(attach):
    endpoint = f"tcp://*:{free_port()}"
    backend, _ = attach(tiny(), tp_rank=1, tp_size=2, extra={"kv_events": {"publisher": "zmq", "endpoint": endpoint}})
    assert backend.events is NO_EVENTS
    rank0, _ = attach(tiny(), tp_rank=0, tp_size=2, extra={"kv_events": {"publisher": "zmq", "endpoint": endpoint}})
    assert rank0.events.on  # the port was free: rank 1 bound nothing


def test_a_taken_endpoint_fails_the_attach_naming_it(attach):
    endpoint = f"tcp://*:{free_port()}"
    first, _ = attach(tiny(), extra={"kv_events": {"publisher": "zmq", "endpoint": endpoint}})
    with pytest.raises(RuntimeError, match=r"kv_events: cannot open the publisher on tcp://\*:\d+"):
        attach(tiny(), extra={"kv_events": {"publisher": "zmq", "endpoint": endpoint}})


def test_the_medium_is_external_for_simm_and_a_memory_store_disk_for_a_store_on_disk(tmp_path, monkeypatch):
    on = {"publisher": "zmq"}
    cluster = SiMMConfig(manager_address="10.0.0.1:30001", kv_events=on)
    assert medium_of(cluster.kv_events, cluster) == "EXTERNAL"
    memory = SiMMConfig(manager_address="local", kv_events=on, client_flags={"local_store_dir": "/dev/shm/x"})
    assert medium_of(memory.kv_events, memory) == ("EXTERNAL" if store_medium("/dev/shm") == "memory" else "DISK")
    disk_dir = str(tmp_path)
    disk = SiMMConfig(manager_address="local", kv_events=on, client_flags={"local_store_dir": disk_dir})
    want = "EXTERNAL" if store_medium(disk_dir) == "memory" else "DISK"
    assert medium_of(disk.kv_events, disk) == want
    forced = SiMMConfig(manager_address="local", kv_events={**on, "medium": "disk"})
    assert medium_of(forced.kv_events, forced) == "DISK"


# ------------------------------------------------------------------ metrics


def test_the_streams_counters_reach_metrics_only_where_it_is_on(stream, attach):
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_simm.exporter import L3Exporter

    backend, host, _ = stream()
    assert all(backend.batch_set_v1(hashes(2, "metrics"), slots(host, 0, 2)))
    flushed(backend)
    registry = CollectorRegistry()
    L3Exporter({"model_name": "m"}, registry=registry).flush(backend.counters.snapshot())
    text = generate_latest(registry).decode()
    assert 'sglang_simm:kv_events_pages_total{dp_rank="",event="stored",model_name="m",pp_rank="",tp_rank=""} 2.0' in text
    assert "sglang_simm:kv_events_dropped_pages_total" in text and "sglang_simm:kv_events_batches_total" in text

    off, _ = attach(tiny())
    quiet = CollectorRegistry()
    L3Exporter({"model_name": "m"}, registry=quiet).flush(off.counters.snapshot())
    samples = [line for line in generate_latest(quiet).decode().splitlines() if not line.startswith("#")]
    assert samples and not [line for line in samples if "kv_events" in line]


def test_the_upstream_change_applies_to_the_installed_sglang():
    """docs/upstream-sglang-l3-events.md's change, as its e2e test applies it
    (``tests/e2e/test_upstream_l3_events.py``): every text it changes is in
    the installed SGLang exactly once, and the changed modules compile."""
    import importlib.util

    from sglang_simm_dev.upstream_l3_events import CHANGES, changed_source

    for module in CHANGES:
        origin = importlib.util.find_spec(module).origin
        with open(origin, encoding="utf-8") as fh:
            source = fh.read()
        changed = changed_source(module, source)
        assert changed != source and "record_backup_stored" in changed
        compile(changed, origin, "exec")
    with pytest.raises(ValueError, match="occurs 0 times"):
        changed_source("sglang.srt.mem_cache.unified_radix_cache", "not SGLang's text")
