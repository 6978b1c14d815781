"""The hybrid demo (``--model <hybrid preset>``): a hybrid model's KV pages and Mamba states through v1 and v2.

A hybrid (linear-attention / Mamba) model keeps, beside its KV pages, one
recurrent state per radix-tree node. SGLang's hybrid cache controller
(0.5.23) stores that state through the v2 interface under the hash of the
node's last KV page, and a prefix is restorable only where both the KV pages
and a state ending exactly there exist. This demo replays that with SGLang's
own host pools (a KV pool and a ``MambaPoolHost``) and the backend called
the way the controller calls it:

* attach: ``register_mem_pool_host`` (KV), ``register_mem_host_pool_v2`` for
  every pool (KV included), ``on_host_pools_registered``;
* write-back: per node, the Mamba state first (``batch_set_v2``), then the
  KV pages (``batch_set_v1``, in batches);
* lookup: ``batch_exists_v2`` with the Mamba query transfer (one placeholder
  key, TRAILING_PAGES): the restorable prefix lengths are the node ends;
* load: KV pages (``batch_get_v1``), then the state of the hit's last page
  (``batch_get_v2``), into other host slots; every byte is compared.

Request B shares a prefix with A that does not end on a node boundary: its
KV pages hit further than any stored state, so the usable hit is the last
node end inside the shared prefix.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

from sglang_simm_dev.demo.common import (
    POISON_BYTE,
    VOCAB_SIZE,
    DemoFailure,
    DemoResult,
    DemoSetupError,
    PageHasher,
    PagePattern,
    Phase,
    human,
    own_local_store,
    quiet_imports,
    resolve_extra,
    run_command,
    sglang_version,
    storage_batch_size,
    wipe,
)
from sglang_simm_dev.pools import ModelGeometry


@dataclass(frozen=True)
class MambaGeometry:
    """One TP rank's recurrent state per radix node (SGLang's Mamba2 shapes)."""

    layers: int
    temporal: tuple[int, ...]
    convs: tuple[tuple[int, ...], ...]
    temporal_dtype: str = "float32"
    conv_dtype: str = "bfloat16"

    def slot_bytes(self) -> int:
        import math

        import torch

        t = math.prod(self.temporal) * torch.empty((), dtype=getattr(torch, self.temporal_dtype)).element_size()
        conv_item = torch.empty((), dtype=getattr(torch, self.conv_dtype)).element_size()
        c = sum(math.prod(s) for s in self.convs) * conv_item
        return self.layers * (t + c)


@dataclass(frozen=True)
class HybridPreset:
    kv: ModelGeometry
    mamba: MambaGeometry
    #: pages per radix node: one state is stored at each node's last page
    node_pages: int
    description: str


#: Hybrid presets, one TP rank each. Qwen3-Next-80B-A3B: 48 layers, every
#: 4th full attention (2 KV heads of 256, one per rank at TP 4), the rest
#: Gated DeltaNet (SGLang's Mamba2StateShape at TP 4: temporal (8, 128, 128)
#: float32, conv (2048, 3) bfloat16).
HYBRID_PRESETS: dict[str, HybridPreset] = {
    "qwen3-next-tp4": HybridPreset(
        kv=ModelGeometry("Qwen/Qwen3-Next-80B-A3B-Instruct", 12, 1, 256, 64),
        mamba=MambaGeometry(36, (8, 128, 128), ((2048, 3),)),
        node_pages=16,
        description="Qwen3-Next-80B-A3B, TP 4: 12 attention + 36 Gated DeltaNet layers",
    ),
    "tiny-hybrid": HybridPreset(
        kv=ModelGeometry("tiny-hybrid-model", 2, 2, 16, 4),
        mamba=MambaGeometry(2, (2, 4, 4), ((3, 8), (5,))),
        node_pages=4,
        description="a small hybrid model for tests",
    ),
}


def is_hybrid_preset(model: str) -> bool:
    return model in HYBRID_PRESETS


def mamba_host_pool(geom: MambaGeometry, slots: int, layout: str = "page_first") -> Any:
    """SGLang's real ``MambaPoolHost`` with at least ``slots`` state slots,
    from a one-slot CPU device buffer (``pin_memory=False``)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    t_dtype, c_dtype = getattr(torch, geom.temporal_dtype), getattr(torch, geom.conv_dtype)
    info = MambaStateBufferInfo(
        temporal=torch.zeros(geom.layers, 1, *geom.temporal, dtype=t_dtype),
        conv=tuple(torch.zeros(geom.layers, 1, *s, dtype=c_dtype) for s in geom.convs),
    )
    return MambaPoolHost(info, float(slots), 0, device_capacity=1, pin_memory=False, device="cpu", layout=layout)


class HybridDemo:
    """The phases; ``run()`` raises DemoFailure on any wrong byte or hit."""

    def __init__(self, console: Any, opts: Any, extra: dict[str, Any]):
        self.console = console
        self.opts = opts
        preset = HYBRID_PRESETS[opts.model]
        kv = preset.kv if opts.page_size is None else dataclasses.replace(preset.kv, page_size=opts.page_size)
        if opts.layout == "page_head":
            raise ValueError(
                "hybrid presets use page_first or page_first_direct (SGLang's Mamba pool has no page_head)"
            )
        self.preset, self.kv_geom, self.node = preset, kv, preset.node_pages
        self.pages = opts.pages if opts.pages is not None else 4 * preset.node_pages
        if self.pages < 2 * self.node:
            raise ValueError(f"--pages must be at least two nodes ({2 * self.node} pages) for {opts.model}")
        self.pages -= self.pages % self.node  # request A ends on a node
        # B shares a prefix that ends inside a node: its KV hit goes further
        # than any state, so the usable hit is the node end before it.
        self.shared = self.pages - self.node // 2 - 1
        self.page_bytes = kv.page_bytes()
        self.state_bytes = preset.mamba.slot_bytes()
        self.nodes = self.pages // self.node
        self.extra, self.resolved = resolve_extra(extra)
        self.result = DemoResult()
        self.seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**32)

    # -- setup ---------------------------------------------------------------

    def _attach(self) -> tuple[Any, Any, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        from sglang_simm import plugin
        from sglang_simm_dev import pools

        config = self.resolved.config
        if config.is_local_store and self.resolved.sources.get("local_store_capacity_bytes") == "default":
            self.extra["local_store_capacity_bytes"] = (
                2 * self.pages * self.page_bytes + (self.nodes + 2) * self.state_bytes + (16 << 20)
            )
        host_pages = 2 * self.pages + 2
        device_tokens = 2 * self.kv_geom.page_size
        device_pool = pools.build_device_pool(self.kv_geom, device_tokens)
        kv = pools.build_host_pool(self.kv_geom, tokens=device_tokens, layout=self.opts.layout,
                                   ratio=host_pages * self.kv_geom.page_size / device_tokens,
                                   device_pool=device_pool)
        mamba = mamba_host_pool(self.preset.mamba, self.nodes + 4, layout=self.opts.layout)
        if not plugin.register():
            raise DemoSetupError("could not register the 'simm' backend with SGLang's storage factory")
        storage_config = pools.storage_config(
            tp_rank=0, tp_size=1, is_mla_model=False, enable_storage_metrics=True,
            is_page_first_layout=self.opts.layout == "page_first", model_name=self.kv_geom.name,
            extra_config=dict(self.extra),
        )
        backend = StorageBackendFactory.create_backend("simm", storage_config, kv)
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backend.on_host_pools_registered()
        return backend, kv, mamba

    # -- checks --------------------------------------------------------------

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            raise DemoFailure(message)

    def _ok(self, message: str) -> None:
        self.console.print(f"  [green]ok[/green]  {message}")

    # -- the run -------------------------------------------------------------

    def run(self) -> DemoResult:
        res = self.result
        t_run = time.perf_counter()
        g = self.kv_geom
        res.info.update(
            model=self.opts.model, model_name=g.name, layout=self.opts.layout, mode="direct-hybrid",
            page_bytes=self.page_bytes, state_bytes=self.state_bytes, pages=self.pages,
            shared_pages=self.shared, node_pages=self.node, seed=self.seed,
            sglang_version=sglang_version(), manager_address=self.resolved.config.manager_address,
        )
        res.expected_verified_bytes = self.pages * self.page_bytes + self.state_bytes + (
            (self.shared // self.node) * self.node * self.page_bytes + self.state_bytes
        )
        try:
            with own_local_store(self.resolved.config):
                with quiet_imports():
                    hasher = PageHasher()
                    backend, kv, mamba = self._attach()
                try:
                    self._phases(backend, kv, mamba, hasher)
                    res.info["backend_stats"] = backend.stats()
                    res.ok = True
                finally:
                    backend.close()
        finally:
            res.total_seconds = time.perf_counter() - t_run
        return res

    def _phases(self, backend: Any, kv: Any, mamba: Any, hasher: PageHasher) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, count_pool_hits

        res, g, ps = self.result, self.kv_geom, self.kv_geom.page_size
        store = backend.client.description
        m = self.preset.mamba
        self.console.print(f"[bold]sglang-simm-dev demo[/bold]: a hybrid model's HiCache L3 path on {store}")
        self.console.print(f"  model     {g.name} ({self.preset.description})")
        self.console.print(f"  page      {human(self.page_bytes)} of KV ({g.layer_num} attention layers, "
                           f"{g.page_size} tokens), layout {self.opts.layout}")
        self.console.print(f"  state     {human(self.state_bytes)} per radix node ({m.layers} layers: "
                           f"temporal {m.temporal} {m.temporal_dtype}, conv {list(m.convs)} {m.conv_dtype})")
        self.console.print(f"  requests  A: {self.pages} pages in {self.nodes} nodes of {self.node}; "
                           f"B: {self.shared} pages shared with A + 1 new")
        self.console.print("  driver    the backend called as SGLang 0.5.23's hybrid controller calls it "
                           "(v2 for the state, v1 for KV)")

        rng = random.Random(self.seed)
        tokens_a = [rng.randrange(VOCAB_SIZE) for _ in range(self.pages * ps)]
        keys_a = hasher(tokens_a, ps)
        kv_pattern = PagePattern(self.page_bytes)
        state_pattern = PagePattern(self.state_bytes, seed=0x3A3B)
        node_ends = [(i + 1) * self.node for i in range(self.nodes)]
        batch = storage_batch_size()
        trailing = PoolHitPolicy.TRAILING_PAGES

        def fill_state(slot: int, key: str) -> None:
            mamba.set_from_flat_data_page(slot, state_pattern.expected(key).clone())

        def state_ok(slot: int, key: str) -> bool:
            got = mamba.get_data_page(slot, flat=True).reshape(-1).view(torch.uint8)
            return torch.equal(got, state_pattern.expected(key))

        # 1. write-back: per node, the state first, then the node's KV pages
        slots_a = kv.alloc(self.pages * ps)
        state_slots = mamba.alloc(self.nodes)
        self._check(slots_a is not None and state_slots is not None, "the host pools have no room for A")
        for p, key in enumerate(keys_a):
            kv_pattern.fill(kv, int(slots_a[p * ps]), key)
        for j, end in enumerate(node_ends):
            fill_state(int(state_slots[j]), keys_a[end - 1])
        t0 = time.perf_counter()
        stored_states = stored_pages = 0
        for j, end in enumerate(node_ends):
            key = keys_a[end - 1]
            got = backend.batch_set_v2([PoolTransfer(
                name=PoolName.MAMBA, host_indices=state_slots[j:j + 1], keys=[key], hit_policy=trailing)])
            stored_states += count_pool_hits(got).get(PoolName.MAMBA, 0)
            for i in range(end - self.node, end, batch):
                chunk = keys_a[i:min(i + batch, end)]
                ok = backend.batch_set_v1(chunk, slots_a[i * ps:(i + len(chunk)) * ps])
                stored_pages += sum(bool(x) for x in ok)
        seconds = time.perf_counter() - t0
        res.phases.append(Phase("write-back", "A", "write", self.pages, pages_moved=stored_pages,
                                     page_bytes=self.page_bytes, seconds=seconds))
        self._check(stored_states == self.nodes and stored_pages == self.pages,
                    f"write-back stored {stored_pages}/{self.pages} pages and {stored_states}/{self.nodes} states")
        self._ok(f"write-back: {self.pages} KV pages and {self.nodes} node states stored")

        # 2. cold restore of A, then 3. request B's shared prefix
        wipe(kv)
        for buf in mamba.get_hybrid_pool_buffer():
            buf.view(-1).view(torch.uint8).fill_(POISON_BYTE)
        self._restore(backend, kv, mamba, hasher, keys_a, "A", node_ends, self.pages,
                      kv_pattern, state_ok, PoolTransfer, PoolName, trailing)
        tokens_b = tokens_a[: self.shared * ps] + [rng.randrange(VOCAB_SIZE) for _ in range(ps)]
        keys_b = hasher(tokens_b, ps)
        self._check(keys_b[: self.shared] == keys_a[: self.shared], "B's shared page keys differ from A's")
        usable = (self.shared // self.node) * self.node
        self._restore(backend, kv, mamba, hasher, keys_b, "B", [e for e in node_ends if e <= self.shared],
                      usable, kv_pattern, state_ok, PoolTransfer, PoolName, trailing,
                      kv_hit=self.shared)

    def _restore(self, backend, kv, mamba, hasher, keys, request, want_stops, want_hit, kv_pattern, state_ok,
                 PoolTransfer, PoolName, trailing, kv_hit=None):
        res, ps = self.result, self.kv_geom.page_size
        t0 = time.perf_counter()
        query = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=trailing)
        r = backend.batch_exists_v2(list(keys), [query])
        lookup = time.perf_counter() - t0
        kv_pages = r.extra_pool_hit_pages.get(PoolName.KV, 0)
        self._check(r.restorable_prefix_pages == want_stops,
                    f"request {request}: restorable prefixes {r.restorable_prefix_pages}, expected {want_stops}")
        self._check(r.kv_hit_pages == want_hit,
                    f"request {request}: usable hit {r.kv_hit_pages} pages, expected {want_hit}")
        if kv_hit is not None:
            self._check(kv_pages == kv_hit, f"request {request}: KV pages found {kv_pages}, expected {kv_hit}")
        hit = r.kv_hit_pages
        slots = kv.alloc(hit * ps)
        state_slot = mamba.alloc(1)
        self._check(slots is not None and state_slot is not None, "the host pools have no room for the restore")
        batch = storage_batch_size()
        t1 = time.perf_counter()
        loaded = 0
        for i in range(0, hit, batch):
            chunk = keys[i:min(i + batch, hit)]
            ok = list(backend.batch_get_v1(chunk, slots[i * ps:(i + len(chunk)) * ps]))
            loaded += len(chunk) if all(ok) else ok.index(False)
            if not all(ok):
                break
        # only when KV completed: the state of the hit's last page
        got = backend.batch_get_v2([PoolTransfer(
            name=PoolName.MAMBA, host_indices=state_slot, keys=[keys[hit - 1]], hit_policy=trailing)])
        seconds = time.perf_counter() - t1
        self._check(loaded == hit, f"request {request}: {loaded} of {hit} KV pages loaded")
        self._check(got.get(PoolName.MAMBA) == [True], f"request {request}: the state at page {hit} did not load")
        bad = [p for p in range(hit) if kv_pattern.check(kv, int(slots[p * ps]), keys[p]) is not None]
        self._check(not bad, f"request {request}: {len(bad)} restored KV pages differ (first: page {bad[:1]})")
        self._check(state_ok(int(state_slot[0]), keys[hit - 1]),
                    f"request {request}: the restored state differs from the one written")
        res.verified_pages += hit
        res.verified_bytes += hit * self.page_bytes + self.state_bytes
        name = "cold restore" if request == "A" else "shared prefix"
        res.phases.append(Phase(name, request, "read", len(keys), hits=hit, pages_moved=loaded,
                                     page_bytes=self.page_bytes, seconds=lookup + seconds, lookup_seconds=lookup,
                                     verified_pages=hit))
        extra = (f"; the KV prefix is {kv_hit} pages but the last state inside it ends at page {hit}"
                 if kv_hit is not None and kv_hit != hit else "")
        self._ok(f"request {request}: restorable at {_short(want_stops)}; {hit} pages and the state at page {hit} "
                 f"loaded, every byte checked{extra}")
        kv.free(slots)
        mamba.free(state_slot)


def _short(stops: list[int]) -> str:
    if len(stops) <= 6:
        return str(stops)
    return f"[{stops[0]}, {stops[1]}, {stops[2]}, ..., {stops[-2]}, {stops[-1]}] ({len(stops)} node ends)"


def list_rows() -> list[tuple[str, str, str, str, str, str, str, str]]:
    """Rows for ``--list-models``: the KV part of each hybrid preset."""
    rows = []
    for key, p in HYBRID_PRESETS.items():
        g = p.kv
        rows.append((key, f"{g.name} (+ state {human(p.mamba.slot_bytes())} per node)", str(g.layer_num),
                     str(g.head_num), str(g.head_dim), str(g.page_size), str(g.dtype).replace("torch.", ""),
                     human(g.page_bytes())))
    return rows


def run(console: Any, opts: Any, extra: dict[str, Any]) -> int:
    """The hybrid demo, reported (``common.run_command``)."""
    return run_command(console, lambda: HybridDemo(console, opts, extra), getattr(opts, "json_path", None),
                       verified="restored pages and their states")
