"""``sglang-simm-dev demo``, run in-process on small geometries.

Both paths: SGLang's own HybridCacheController driving the backend (the
default) and the backend called directly (``--direct``). Every run must
verify every restored byte, find exactly the expected pages, and fail (exit
1) when the store hands back wrong or missing data.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import uuid

import pytest

pytest.importorskip("rich")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from sglang_simm_dev import cli  # noqa: E402
from sglang_simm_dev import demo  # noqa: E402
from sglang_simm_dev.demo import common, kv  # noqa: E402
from sglang_simm.local_store import reset_servers, server_names  # noqa: E402
from sglang_simm.local_store._handle import StoreHandle  # noqa: E402
from sglang_simm.local_store._maps import SegmentMap  # noqa: E402

pytestmark = pytest.mark.local_store

PATHS = [pytest.param([], id="controller"), pytest.param(["--direct"], id="direct")]


@pytest.fixture(scope="module", autouse=True)
def sglang_ready():
    """Import SGLang's HiCache modules and build its native page hash once,
    so that cost is not charged to the first test."""
    with common.quiet_imports():
        import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller  # noqa: F401
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    common.sglang_hash_function()


def run(tmp_path, *argv, extra=None, store="local"):
    """Run the demo on a fresh local store (``store``: "local", the local
    store the demo uses by default, or "inprocess", whose objects a test
    can reach); (exit code, JSON, console text)."""
    name = f"demo-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / f"{name}.json"
    args = cli.build_parser().parse_args(["demo", *argv, "--json", str(out)])
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    config = {"manager_address": f"{store}://{name}"}
    config.update(extra or {})
    try:
        code = demo.run_demo(console, args, config)
    finally:
        reset_servers(name)
    data = json.loads(out.read_text()) if out.exists() else None
    return code, data, console.file.getvalue()


def phases(data):
    return {p["name"]: p for p in data["phases"]}


def check_success(code, data, text, *, pages, mode):
    assert code == 0, text
    assert data["ok"] is True and data["error"] is None
    assert data["mode"] == mode, data.get("controller_error")
    shared, new = kv.split_request(pages)
    assert (data["pages"], data["shared_pages"], data["new_pages"]) == (pages, shared, new)
    # every restored byte was compared: request A, B's prefix, B's new pages
    assert data["verified_pages"] == pages + shared + new
    assert data["verified_bytes"] == data["expected_verified_bytes"] == (pages + shared + new) * data["page_bytes"]
    ph = phases(data)
    assert ph["write-back"]["pages_moved"] == pages
    cold = ph["cold restore"]
    assert (cold["hits"], cold["pages_moved"], cold["hit_rate"]) == (pages, pages, 1.0)
    assert cold["relocated_pages"] == pages  # loaded into other host slots than written from
    prefix = ph["prefix hit"]
    assert prefix["pages"] == pages and prefix["hits"] == shared and prefix["pages_moved"] == shared
    assert prefix["hit_rate"] == pytest.approx(shared / pages)
    assert ph["write new"]["pages_moved"] == new
    back = ph["read new"]
    assert (back["hits"], back["pages_moved"], back["hit_rate"]) == (new, new, 1.0)
    assert back["relocated_pages"] == new
    assert "all checks passed" in text


@pytest.mark.parametrize("path", PATHS)
def test_demo_mha_multi_batch(tmp_path, path):
    # 300 pages: the write-back and the restore span three 128-page batches
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "300", *path)
    check_success(code, data, text, pages=300, mode="direct" if path else "controller")
    assert data["batch_size"] == 128
    assert data["hash_function"].startswith("sglang.") or data["hash_fallback_reason"]
    stats = data["backend_stats"]
    assert stats["pages_written"] == 300 + data["new_pages"]
    assert stats["pages_read"] == data["verified_pages"]
    # the write-backs are held against a same-run memcpy into new memory and into memory in use
    ref = data["memcpy_reference"]
    assert ref["new_memory_gbps"] > 0 and ref["memory_in_use_gbps"] > 0
    assert ref["bytes"] % ref["object_bytes"] == 0 and ref["memory"] == "new shared memory (memfd)"
    assert "into the same memory again" in " ".join(text.split())


@pytest.mark.parametrize("path", PATHS)
def test_demo_mla_deepseek_v3(tmp_path, path):
    code, data, text = run(tmp_path, "--model", "deepseek-v3", "--page-size", "8", "--pages", "8", *path)
    check_success(code, data, text, pages=8, mode="direct" if path else "controller")
    assert data["geometry"]["is_mla"] is True
    assert data["page_bytes"] == 61 * 8 * (512 + 64) * 2  # one object a page


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_demo_other_layouts(tmp_path, layout):
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "9", "--layout", layout)
    check_success(code, data, text, pages=9, mode="controller")
    assert data["layout"] == layout


@pytest.mark.parametrize("path", PATHS)
def test_corrupted_store_fails(tmp_path, monkeypatch, path):
    """One byte of one stored object flipped inside the local store's segment."""
    corrupted = []
    write = SegmentMap.write

    def write_and_corrupt(self, copies):
        write(self, copies)
        if not corrupted and len(copies) > 1:  # a batch of pages, not a warm-up's one object
            offset, _src, size = copies[0]
            byte = ctypes.c_uint8.from_address(self.base + offset + size // 2)
            byte.value ^= 0xFF
            corrupted.append(offset)

    monkeypatch.setattr(SegmentMap, "write", write_and_corrupt)
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "8", *path, store="inprocess")
    assert corrupted
    assert code == 1, text
    assert data["ok"] is False
    assert "differ from what was written" in data["error"]
    assert "FAILED" in text
    assert data["verified_bytes"] < data["expected_verified_bytes"]


def test_backend_returning_wrong_data_fails(tmp_path, monkeypatch):
    """A backend whose get reports success but leaves one wrong byte."""
    from sglang_simm.backend import HiCacheSiMM

    get = HiCacheSiMM.batch_get_v1

    def wrong_get(self, keys, host_indices, extra_info=None):
        ok = get(self, keys, host_indices, extra_info)
        page = self.mem_pool_host.kv_buffer[1, int(host_indices[-1])]  # page_first: V of the last page
        page.view(-1).view(torch.uint8)[0] ^= 0x01
        return ok

    monkeypatch.setattr(HiCacheSiMM, "batch_get_v1", wrong_get)
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "8")
    assert code == 1, text
    assert "differ from what was written" in data["error"]


@pytest.mark.parametrize("path", PATHS)
def test_lost_page_fails(tmp_path, monkeypatch, path):
    """The store loses one object of page 5 right after storing it: the
    cold restore's lookup stops there."""
    seen = []
    put_from = StoreHandle.put_from

    def put_and_lose(self, items, overwrite):
        codes = put_from(self, items, overwrite)
        for key, _ptr, _size in items:
            if "warmup" not in key:
                seen.append(key)
                if len(seen) == 11:  # page 5's second object (K and V a page)
                    self.delete(key)
        return codes

    monkeypatch.setattr(StoreHandle, "put_from", put_and_lose)
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "16", *path, store="inprocess")
    assert code == 1, text
    cold = phases(data)["cold restore"]
    assert (cold["hits"], cold["hit_rate"]) == (5, 5 / 16)
    assert "cold restore: the lookup found 5 of 16 pages" in data["error"]


def test_store_refusing_writes_fails(tmp_path):
    """A local store too small for even one batch: the write-back fails."""
    page_bytes = kv.resolve_geometry("tiny", None).page_bytes()
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "16",
                           extra={"local_store_capacity_bytes": 8 * page_bytes})
    assert code == 1, text
    assert phases(data)["write-back"]["pages_moved"] < 16
    assert "write-back stored" in data["error"]


def test_python_page_hash_matches_sglang():
    fn, why = common.sglang_hash_function()
    if fn is None:
        pytest.skip(f"SGLang's native page hash is not available: {why}")
    tokens = list(range(1000, 1000 + 4 * 16)) + [2**32 - 1] * 4
    assert common.python_page_hashes(tokens, 4) == list(fn(tokens, None, page_size=4))
    prior = common.python_page_hashes(tokens[:8], 4)[-1]
    assert common.python_page_hashes(tokens[8:], 4, prior) == common.python_page_hashes(tokens, 4)[2:]


def test_list_models_and_bad_options(tmp_path):
    console = Console(file=io.StringIO(), width=160)
    assert demo.run_demo(console, cli.build_parser().parse_args(["demo", "--list-models"]), {}) == 0
    listing = console.file.getvalue()
    assert "llama3-8b" in listing and "deepseek-v3" in listing
    before = set(server_names())
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "1")
    assert code == 2 and "at least 2" in text
    code, data, text = run(tmp_path, "--model", "no-such-model", "--pages", "4")
    assert code == 2 and "unknown model preset" in text
    assert set(server_names()) == before


def test_server_demo_options_without_server_are_refused_not_ignored(capsys):
    code = cli.main(["demo", "--preset", "llama-tiny", "--new-tokens", "4"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "--preset, --new-tokens belong to the server demo: add --server" in out


def test_cli_entry_point(tmp_path):
    name = f"demo-cli-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "cli.json"
    try:
        code = cli.main(["demo", "--model", "tiny", "--pages", "4", "--direct",
                         "--manager", f"local://{name}", "--json", str(out)])
    finally:
        reset_servers(name)
    assert code == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["manager_address"] == f"local://{name}"


def test_controller_with_python_page_hash(tmp_path, monkeypatch):
    """Where SGLang's native page hash cannot be built (no compiler or
    OpenSSL headers), the demo keys pages, and has the controller key its
    lookups, with the Python re-implementation; SGLang's function is put
    back afterwards."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hcc

    original = hcc.get_storage_hash_str
    monkeypatch.setattr(common, "sglang_hash_function", lambda: (None, "disabled by the test"))
    code, data, text = run(tmp_path, "--model", "tiny", "--pages", "12")
    check_success(code, data, text, pages=12, mode="controller")
    assert data["hash_fallback_reason"] == "disabled by the test"
    assert hcc.get_storage_hash_str is original


def test_demo_leaves_a_host_store_it_did_not_start_running(tmp_path, host_store_dir):
    """A store a server on this host already serves is not the demo's to stop."""
    from sglang_simm.local_store._handle import StoreHandle, pid_alive

    name = f"demo-shared-{uuid.uuid4().hex[:8]}"
    running = StoreHandle(name, root=host_store_dir, capacity=64 << 20)
    running.open()
    try:
        args = cli.build_parser().parse_args(["demo", "--model", "tiny", "--pages", "4", "--direct"])
        console = Console(file=io.StringIO(), width=120, force_terminal=False)
        assert demo.run_demo(console, args, {"manager_address": f"local://{name}"}) == 0
        assert pid_alive(running.pid) and running.status()["objects"] > 0
    finally:
        running.stop()


def test_demo_on_its_own_store_leaves_nothing_in_the_store_directory(tmp_path, host_store_dir):
    """The store the demo starts for itself goes with it, lock and log too
    (a store's own stop keeps those), so runs do not pile files up in the
    operator's store directory."""
    before = set(os.listdir(host_store_dir))
    args = cli.build_parser().parse_args(["demo", "--model", "tiny", "--pages", "4", "--direct",
                                          "--json", str(tmp_path / "own.json")])
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    assert demo.run_demo(console, args, {}) == 0
    data = json.loads((tmp_path / "own.json").read_text())
    assert data["ok"] and data["manager_address"].startswith("local://demo-")
    assert set(os.listdir(host_store_dir)) - before == set()


def test_demo_on_its_own_store_in_a_configured_directory_leaves_nothing_there(tmp_path, host_store_dir):
    """A config naming ``local_store_dir`` (and no ``manager_address``):
    the demo's own store lives in a private directory under that one, and
    goes with it."""
    chosen = os.path.join(host_store_dir, f"chosen-{os.getpid()}")
    os.makedirs(chosen, mode=0o700)
    args = cli.build_parser().parse_args(["demo", "--model", "tiny", "--pages", "4", "--direct",
                                          "--json", str(tmp_path / "own.json")])
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    extra = {"client_flags": {"local_store_dir": chosen}}
    assert demo.run_demo(console, args, extra) == 0
    data = json.loads((tmp_path / "own.json").read_text())
    assert data["ok"] and data["manager_address"].startswith("local://demo-")
    assert os.listdir(chosen) == []


def test_demo_default_store_is_its_own(tmp_path):
    extra, resolved = common.resolve_extra({})
    assert resolved.config.local_store_scope == "host" and resolved.config.local_store_name.startswith("demo-")


@pytest.mark.parametrize("width", [80, 40])
def test_list_models_shows_every_preset_name_whole(width):
    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    assert demo.run_demo(console, cli.build_parser().parse_args(["demo", "--list-models"]), {}) == 0
    first_words = {line.split()[0] for line in console.file.getvalue().splitlines() if line.strip()}
    names = demo.preset_names()
    assert len(names) == 7 and {"tiny-hybrid", "qwen3-next-tp4", "llama3-70b-tp4"} <= set(names)
    assert set(names) <= first_words


def test_unknown_preset_lists_every_preset(tmp_path):
    code, _, text = run(tmp_path, "--model", "llama3-7b")
    assert code == 2
    flat = " ".join(text.split())
    assert "unknown model preset 'llama3-7b'" in flat
    assert f"choose one of: {', '.join(demo.preset_names())}" in flat


def test_waiting_on_a_controller_queue_yields_what_comes_and_fails_by_name_past_the_deadline():
    import queue
    import time

    from sglang_simm_dev.demo import drivers
    from sglang_simm_dev.demo.common import DemoFailure

    q = queue.Queue()
    q.put("first")
    idle = []
    items = drivers._items(q, time.monotonic() + 0.3, "the backup thread did not answer", idle=lambda: idle.append(1))
    assert next(items) == "first"
    with pytest.raises(DemoFailure, match="the backup thread did not answer"):
        next(items)
    assert idle  # polled while waiting (the demo's progress line moves)


def _row(tier, ttft, fresh, cached=512, prompt=576):
    from sglang_simm_dev.server_demo import Row

    return Row("r", tier, prompt, cached, ttft, 0, True, fresh)


def test_server_demo_speedup_is_each_rows_own_fresh_run_over_its_ttft():
    # it divided by the mean of every fresh run, none of them printed
    # (5926 / 2390 = 2.48x shown as 2.9x)
    from sglang_simm_dev.server_demo import speedup

    assert speedup(_row("L3 hit (SiMM)", 2.390, 5.926)) == "2.5x"
    assert speedup(_row("computed from scratch", 5.0, 5.0, cached=0)) == "1.0x"


def test_server_demo_lists_rows_nearest_tier_first_whatever_their_times():
    # measured first user first; listed device, host, L3, then from scratch
    from sglang_simm_dev.server_demo import TIERS, in_tier_order

    measured = [_row("computed from scratch", 6.0, 6.0, cached=0), _row("device hit (L1)", 2.7, 6.1),
                _row("host-tier hit (L2)", 2.2, 6.0), _row("L3 hit (SiMM)", 2.4, 6.0)]
    assert [r.tier for r in in_tier_order(measured)] == list(TIERS)
    assert [r.tier for r in in_tier_order(measured[::-1])] == list(TIERS)


@pytest.mark.parametrize("device_ttft, floor, spread", [(2.7, "2200", "2200-2700"), (2.1, "2100", "2100-2400")],
                         ids=["device-slowest", "device-fastest"])
def test_server_demo_explains_the_floor_and_the_noise_in_every_run(device_ttft, floor, spread):
    # the note once came only in runs where the device row was slower than the host row
    from sglang_simm_dev.server_demo import notes

    rows = [_row("device hit (L1)", device_ttft, 6.1), _row("host-tier hit (L2)", 2.2, 6.0),
            _row("L3 hit (SiMM)", 2.4, 6.0), _row("computed from scratch", 6.0, 6.0, cached=0)]
    rows[1].kv_bytes_moved = rows[2].kv_bytes_moved = 32 << 20
    text = " ".join(notes(rows, 0.4))
    assert f"floor no tier removes, about {floor} ms" in text and "whole 576-token prompt" in text
    assert "the 64-token question sent alone, no system prompt, took 400 ms" in text
    assert "torch_native" in text and f"spread here ({spread} ms)" in text
    assert "timing noise" in text and "32.0 MiB for the host-tier hit (L2) and 32.0 MiB for the L3 hit (SiMM)" in text
    assert notes(rows[3:], 0.4) == []  # nothing cached, nothing to explain


def test_server_demo_l3_row_reads_the_backends_writes_not_l2_backups():
    # sglang:hicache_backup_bytes_total counts device-to-host (L2) backups:
    # a server with no L3 at all reported 4.24 GB of it as "L3 written"
    from sglang_simm_dev.server_demo import l3_written

    assert l3_written({"sglang:hicache_backup_bytes_total": 4.24e9}, 1024).startswith("not reported")
    got = l3_written({"sglang:hicache_backup_bytes_total": 4.24e9, "sglang:backup_pgs_sum": 10.0,
                      "sglang:backuped_tokens_total": 160.0}, 1024)
    assert got.startswith("10 pages, 10.0 KiB") and "160 tokens" in got
