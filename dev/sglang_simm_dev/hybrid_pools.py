"""Every host pool type SGLang 0.5.23 hands a storage backend, built on the
CPU the way its hybrid pool assembler builds it, and the transfers its hybrid
cache controller sends for them: an instrument for the tests
(``tests/test_pools_0523.py``) and the compat probe (``compat_probe``), which
round-trips every stack here that a release can build (:func:`round_trip`).

Each builder mirrors one assembler path of
``sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py`` (0.5.23),
cited as ``assembler:LINE``, over SGLang's own CPU device pools, and differs
from it only where a CPU must: ``pin_memory=False`` (pinning needs a GPU
driver), small sizes, and the layout passed in rather than read from
``--hicache-mem-layout``. The assembler's own private helpers are used where
it has them (``_mha_host_inputs``, the DeepSeek V4 region resolvers).
:data:`STACKS` names every stack; MXFP8 (:func:`mxfp8_host_pool`) is a pool of
its own, which the backend refuses.

A release without one of these classes or helpers makes the builder that
needs it raise :class:`Missing` (:func:`sglang_attr`), naming what it lacks:
the tests skip on it, the compat probe records it. Nothing here imports
pytest or the tests; :func:`factory_attach` attaches a backend through
SGLang's ``StorageBackendFactory`` as the tests' ``attach`` fixture does.

How the controller (``hybrid_cache/hybrid_cache_controller.py``, cited as
``controller:LINE``) addresses each pool, which :func:`backup` and
:func:`prefetch` replay:

* the KV anchor: ``batch_set_v1`` / ``batch_get_v1`` with the anchor's token
  slots, a page of ``page_size`` slots per key (managers/cache_controller.py
  ``_page_backup``:1416, ``_page_transfer``:1155);
* a KV-derived sidecar (``SidecarPoolSpec(indices_from_pool=KV)``: DSA/QSA/
  MiniMax indexers, DeepSeek V4 C4/C128 regions, draft KV): ``batch_*_v2``
  with the anchor's own token slots and the KV keys
  (``_resolve_sidecar_kv_derived_pool_transfers``, controller:1778-1782), read
  in the same batch as the KV pages (managers/cache_controller.py:1208-1245,
  ``_page_transfer_kv_batch``);
* a pool with its own slots (SWA, Mamba): its own host slots, TRAILING_PAGES,
  keys the node's last pages (SWA, components/swa.py:1207-1221) or its last
  page (Mamba, components/mamba.py:917-927), read after KV completes with the
  keys re-aligned to the hit (``_sync_trailing_keys``, controller:1809);
* a pool deriving its slots from SWA (DeepSeek V4 compress states): SWA's
  slots and keys (``_resolve_sidecar_nonkv_derived_pool_transfers``,
  controller:1784).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch

from sglang_simm_dev.pools import MAMBA_CAPACITY, create_backend, mamba_pool

#: CPU stand-ins for what the assembler reads from the server arguments
ALLOCATOR = "default"  # get_allocator_type() for every backend but shm
RATIO = 2.0  # --hicache-ratio


# ----------------------------------------------------------------- classes


class Missing(LookupError):
    """The installed SGLang lacks what a stack needs (the message names it)."""


def sglang_attr(module: str, name: str) -> Any:
    """``module.name`` of the installed SGLang, or :class:`Missing` naming
    what this release lacks."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise Missing(f"this SGLang ({sglang_version()}) has no {module}") from e
    obj = getattr(mod, name, None)
    if obj is None:
        raise Missing(f"this SGLang ({sglang_version()}) has no {module}.{name}")
    return obj


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # pragma: no cover - an unusual install
        return "unknown version"


def _assembler(name: str) -> Any:
    return sglang_attr("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", name)


def pool_names() -> Any:
    return sglang_attr("sglang.srt.mem_cache.hicache_storage", "PoolName")


def hit_policies() -> Any:
    return sglang_attr("sglang.srt.mem_cache.hicache_storage", "PoolHitPolicy")


# ------------------------------------------------------------ host memory


def host_tensors(pool) -> list[torch.Tensor]:
    """Every host tensor of a pool that holds page bytes (none for a logical
    pool), each once."""
    found: list[torch.Tensor] = []
    candidates: list[Any] = []
    if hasattr(pool, "get_hybrid_pool_buffer"):
        candidates += list(pool.get_hybrid_pool_buffer())
    kv = getattr(pool, "kv_buffer", None)
    candidates += list(kv) if isinstance(kv, (list, tuple)) else [kv]
    candidates += [getattr(pool, name, None) for name in ("k_scale_host", "v_scale_host")]
    seen = set()
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            found.append(t)
    return found


def scramble(pool, seed: int) -> None:
    """Random bytes over all of a pool's host memory."""
    gen = torch.Generator().manual_seed(seed)
    for t in host_tensors(pool):
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def page_objects(pool, indices: torch.Tensor) -> list[bytes]:
    """The bytes of every storage object SGLang's own ``get_page_buffer_meta``
    names for these host indices (one page), read where it points; a pool
    whose meta refuses (Mamba with side states) gives its flat data page."""
    try:
        meta = pool.get_page_buffer_meta(indices)
    except NotImplementedError:
        return [pool.get_data_page(int(indices[0]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()]
    if meta is None:  # a logical pool: no bytes
        return []
    ptrs, sizes = meta
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in host_tensors(pool)]
    for p, n in zip(ptrs, sizes):
        inside = any(lo <= p and p + n <= hi for lo, hi in spans)
        assert inside, f"{type(pool).__name__}: object at {p:#x} outside its buffers"
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def slots(pool, first_page: int, n: int = 1) -> torch.Tensor:
    ps = pool.page_size
    return torch.arange(first_page * ps, (first_page + n) * ps, dtype=torch.int64)


# ------------------------------------------------------------------ stacks


@dataclass
class Side:
    """One pool-group entry besides the KV anchor, as the controller
    addresses it."""

    name: Any  # PoolName
    pool: Any
    policy: Any  # PoolHitPolicy
    #: PoolName.KV: KV-derived (the anchor's slots and keys); PoolName.SWA:
    #: SWA's; None: its own slots
    source: Any = None
    #: trailing pages a TRAILING_PAGES pool keeps per node (1 for Mamba);
    #: None: every page of the node
    window: Optional[int] = None
    #: registered after on_host_pools_registered (draft sidecars,
    #: controller:368-375 through kv_cache_builder.maybe_register_hicache_draft)
    late: bool = False


@dataclass
class Stack:
    """A host pool group as the assembler returns it, less the controller."""

    label: str
    anchor: Any
    sides: list[Side] = field(default_factory=list)
    #: HiCacheStorageConfig.is_mla_model: is_rank_replicated
    #: (managers/cache_controller.py:771-775, 802)
    is_mla: bool = False
    model_name: str = "tiny-test-model"

    def side(self, name) -> Side:
        return next(s for s in self.sides if s.name == name)

    def pools(self) -> dict[Any, Any]:
        return {pool_names().KV: self.anchor, **{s.name: s.pool for s in self.sides}}


def attach_stack(attach, stack: Stack, **fields):
    """The backend, attached as SGLang 0.5.23's hybrid controller attaches
    it: ``create_backend`` + ``register_mem_pool_host`` for the anchor
    (managers/cache_controller.py:614-617), then every pool-group entry, KV
    included, through ``register_mem_host_pool_v2`` and
    ``on_host_pools_registered`` (controller:355-357); draft sidecars after
    that (``register_host_pool_entry``, controller:368-375)."""
    PoolName = pool_names()
    geom = SimpleNamespace(name=stack.model_name, is_mla=stack.is_mla, page_size=stack.anchor.page_size)
    backend, _ = attach(geom, pool=stack.anchor, **fields)
    backend.register_mem_host_pool_v2(stack.anchor, PoolName.KV)
    for side in stack.sides:
        if not side.late:
            backend.register_mem_host_pool_v2(side.pool, side.name)
    backend.on_host_pools_registered()
    for side in stack.sides:
        if side.late:
            backend.register_mem_host_pool_v2(side.pool, side.name)
    return backend


class FactoryAttach:
    """The tests' ``attach`` fixture without pytest, for :func:`attach_stack`:
    ``attach(geom, *, pool, **fields) -> (backend, pool)`` builds the backend
    through SGLang's ``StorageBackendFactory`` on ``route`` over the store at
    ``manager_address`` (``pools.create_backend``, as ``compat_probe`` does);
    :meth:`close` closes every backend it made."""

    def __init__(self, route: str, manager_address: str):
        self.route, self.manager_address = route, manager_address
        self.made: list[Any] = []

    def __call__(self, geom, *, pool, **fields):
        fields.setdefault("is_mla_model", geom.is_mla)
        fields.setdefault("model_name", geom.name)
        backend = create_backend(self.route, pool, manager_address=self.manager_address, **fields)
        self.made.append(backend)
        return backend, pool

    def close(self) -> None:
        while self.made:
            self.made.pop().close()


def transfer(name, *, keys, host_indices=None, policy=None):
    """SGLang's ``PoolTransfer`` for pool ``name`` (``ALL_PAGES`` unless
    ``policy`` says otherwise)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    return PoolTransfer(
        name=name, keys=keys, host_indices=host_indices,
        hit_policy=policy if policy is not None else PoolHitPolicy.ALL_PAGES,
    )


def hashes(n: int, salt: str = "") -> list[str]:
    """``n`` page keys as SGLang spells them (sha256 hex), salted."""
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


@dataclass
class Plan:
    """Where each pool's pages of one round trip live: written from
    ``src``, read back into ``dst`` (other slots), per pool name."""

    keys: list[str]
    #: node spans (page ranges) backed up one operation each
    nodes: list[tuple[int, int]]
    src: dict[Any, list[torch.Tensor]]  # per pool: per page (per node for window-1 pools)
    dst: dict[Any, list[torch.Tensor]]


def plan(stack: Stack, pages: int = 3, nodes=((0, 2), (2, 3)), keys: Optional[list[str]] = None) -> Plan:
    """Pages 1..pages of every pool written, read back into the pages after
    them; a window-1 pool (Mamba) gets one slot per node. Two nodes by
    default, as a radix node of two pages and its child of one: both a
    multi-page and a single-page backup."""
    PoolName = pool_names()
    keys = keys or hashes(pages, stack.label)
    src = {PoolName.KV: [slots(stack.anchor, 1 + p) for p in range(pages)]}
    dst = {PoolName.KV: [slots(stack.anchor, 1 + pages + p) for p in range(pages)]}
    for side in stack.sides:
        if side.source is None:
            n = len(nodes) if side.window == 1 else pages
            src[side.name] = [slots(side.pool, 1 + p) for p in range(n)]
            dst[side.name] = [slots(side.pool, 1 + n + p) for p in range(n)]
    for side in stack.sides:
        if side.source is not None:
            src[side.name], dst[side.name] = src[side.source], dst[side.source]
    return Plan(keys=keys, nodes=list(nodes), src=src, dst=dst)


def _side_transfers(stack: Stack, p: Plan, where: str, span: tuple[int, int], node: int, *, kv_derived: bool):
    """The v2 transfers of one operation covering pages ``span``."""
    PoolName = pool_names()
    lo, hi = span
    keys = p.keys[lo:hi]
    out = []
    for side in stack.sides:
        if (side.source == PoolName.KV) != kv_derived:
            continue
        slots_of = getattr(p, where)[side.name]
        if side.window == 1:
            idx, ks = slots_of[node], keys[-1:]
        else:
            w = len(keys) if side.window is None else min(side.window, len(keys))
            idx, ks = torch.cat(slots_of[hi - w:hi]), keys[-w:]
        out.append(transfer(side.name, keys=ks, host_indices=idx, policy=side.policy))
    return out


def backup(backend, stack: Stack, p: Plan, *, writer: bool = True) -> dict:
    """Back the pages up as the controller does, one operation per node
    (``_page_backup_with_stable_layout``, controller:1694-1737): the v2
    transfers SGLang's ``should_backup`` (controller:1739) passes, then, on
    the storage writer only, the KV pages on v1."""
    PoolName = pool_names()
    results: dict = {}
    for node, span in enumerate(p.nodes):
        lo, hi = span
        v2 = _side_transfers(stack, p, "src", span, node, kv_derived=True)
        v2 += _side_transfers(stack, p, "src", span, node, kv_derived=False)
        v2 = [t for t in v2 if should_backup(stack, writer=writer, name=t.name)]
        if v2:
            for name, ok in backend.batch_set_v2(v2).items():
                results.setdefault(name, []).extend(ok)
        if writer:
            ok = backend.batch_set_v1(p.keys[lo:hi], torch.cat(p.src[PoolName.KV][lo:hi]))
            results.setdefault(PoolName.KV, []).extend(ok)
    return results


def prefetch(backend, stack: Stack, p: Plan, pages: Optional[int] = None) -> dict:
    """Read a hit of ``pages`` pages back into the ``dst`` slots as the
    controller does: KV on v1 with the KV-derived sidecars beside it
    (``_page_transfer_kv_batch``), then the other pools with their keys
    aligned to the hit (``_page_transfer_with_stable_layout`` and
    ``_page_transfer_sidecar``, controller:1608-1668)."""
    PoolName = pool_names()
    n = len(p.keys) if pages is None else pages
    span, node = (0, n), next(i for i, (lo, hi) in enumerate(p.nodes) if hi == n)
    results = {PoolName.KV: backend.batch_get_v1(p.keys[:n], torch.cat(p.dst[PoolName.KV][:n]))}
    kv_derived = _side_transfers(stack, p, "dst", span, node, kv_derived=True)
    if kv_derived:
        results.update(backend.batch_get_v2(kv_derived))
    if all(results[PoolName.KV]) and all(all(v) for v in results.values()):
        others = _side_transfers(stack, p, "dst", span, node, kv_derived=False)
        if others:
            results.update(backend.batch_get_v2(others))
    return results


def queries(stack: Stack) -> list:
    """The v2 transfers of a storage hit query (``_build_sidecar_transfers``
    in PREFETCH, unified_radix_cache.py:1939-1991, and each component's
    PREFETCH placeholders)."""
    PoolName = pool_names()
    out = []
    for side in stack.sides:
        if side.source == PoolName.KV:
            keys = None  # the KV transfer's keys, unset at query time
        elif side.window == 1:
            keys = ["__placeholder__"]
        else:
            keys = ["__placeholder__"] * (side.window or 3)
        if side.source is not None and side.source != PoolName.KV:
            keys = ["__placeholder__"] * (stack.side(side.source).window or 3)
        out.append(transfer(side.name, keys=keys, policy=side.policy))
    return out


def snapshot(stack: Stack, p: Plan, where: str = "src") -> dict[Any, list[list[bytes]]]:
    """Each pool's objects, page by page, at the plan's slots."""
    return {name: [page_objects(pool, idx) for idx in getattr(p, where)[name]] for name, pool in stack.pools().items()}


def scramble_all(stack: Stack, seed: int) -> None:
    for i, pool in enumerate(stack.pools().values()):
        scramble(pool, seed * 100 + i)


# ------------------------------------------------------------- MHA / MLA


def mha_device_pool(*, tokens: int, page_size: int, head_num: int, head_dim: int, layer_num: int,
                    v_head_dim: Optional[int] = None, cls: Any = None, dtype=torch.bfloat16):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (cls or MHATokenToKVPool)(
        size=tokens, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
        v_head_dim=v_head_dim, layer_num=layer_num, device="cpu", enable_memory_saver=False,
        enable_alt_stream=False,
    )


def mha_host_pool(device_pool, *, layout: str, page_size: Optional[int] = None, pool_label: str = "kv",
                  host_token_capacity: Optional[int] = None, ratio: float = RATIO):
    """``build_kv_host_pool`` for an MHA device pool (assembler:164-236):
    the class ``get_mha_host_pool_cls`` picks from the pool's buffer info
    (MHA, asymmetric K/V, MXFP8), with ``_mha_host_inputs``' arguments."""
    host_cls, host_input, host_kwargs = _assembler("_mha_host_inputs")(device_pool)
    return host_cls(
        host_input, ratio, 0, page_size or device_pool.page_size, layout,
        pin_memory=False, device="cpu", allocator_type=ALLOCATOR, pool_label=pool_label,
        **({"host_token_capacity": host_token_capacity} if host_token_capacity else {}),
        **host_kwargs,
    )


def mla_host_pool(device_pool, *, layout: str):
    """``build_kv_host_pool`` for an MLA device pool (assembler:164-236)."""
    cls = sglang_attr("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost")
    return cls(
        device_pool.get_device_pool_infos()[0].buffer_info, RATIO, 0, device_pool.page_size, layout,
        pin_memory=False, device="cpu", allocator_type=ALLOCATOR, pool_label="kv",
        override_kv_cache_dim=device_pool.kv_cache_dim,
        device_capacity_tokens=device_pool.size, start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer, draft_buffer_infos=(), layer_shard_enabled=False,
        target_layer_num=device_pool.layer_num,
    )


def mimo_v2(layout: str) -> Stack:
    """MiMo-V2 (hybrid SWA, K head dim 192 != V head dim 128), scaled down:
    ``build_hybrid_swa_group`` (assembler:365-505) builds the full-attention
    anchor and the SWA pool with ``build_kv_host_pool``; both are
    ``AsymmetricMHATokenToKVPoolHost`` (pool_host/mha.py:1684-1699)."""
    PoolName, Policy = pool_names(), hit_policies()
    sglang_attr("sglang.srt.mem_cache.pool_host.mha", "AsymmetricMHATokenToKVPoolHost")
    geometry = dict(page_size=4, head_num=2, head_dim=24, v_head_dim=16)
    full = mha_device_pool(tokens=32, layer_num=2, **geometry)
    swa = mha_device_pool(tokens=32, layer_num=1, **geometry)
    return Stack(
        "mimo-v2", mha_host_pool(full, layout=layout, pool_label="full"),
        # SWA: own slots, the node's trailing pages (components/swa.py:1207-1220)
        [Side(PoolName.SWA, mha_host_pool(swa, layout=layout, pool_label="swa"), Policy.TRAILING_PAGES)],
        model_name="tiny-mimo-v2",
    )


# ---------------------------------------------------------------- MiniMax


def minimax_m3(layout: str) -> Stack:
    """MiniMax M3 sparse, index-K only: ``build_minimax_sparse_hicache_stack``
    (assembler:2559-2725): the main pool's MHA host as the anchor and
    ``MHATokenToKOnlyPoolHost(index_k_pool, kv_host_pool, layout)``
    (assembler:2687) as ``PoolName.INDEXER``, a KV-derived ALL_PAGES sidecar
    (``_MiniMaxSparseStrategy.build``, assembler:2277-2283)."""
    PoolName, Policy = pool_names(), hit_policies()
    kpool_host = sglang_attr("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKOnlyPoolHost")
    sparse_cls = sglang_attr("sglang.srt.mem_cache.memory_pool", "MiniMaxSparseKVPool")
    sparse = sparse_cls(
        size=32, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, idx_head_dim=32,
        dense_layer_ids=[0], sparse_layer_ids=[1, 2], disable_value_sparse_layer_ids=[1, 2],
        device="cpu", start_layer=0, end_layer=3,
    )
    anchor = mha_host_pool(sparse.main_pool, layout=layout)
    index = kpool_host(sparse.index_k_pool, anchor, layout, pin_memory=False, device="cpu", allocator_type=ALLOCATOR)
    return Stack("minimax-m3", anchor, [Side(PoolName.INDEXER, index, Policy.ALL_PAGES, source=PoolName.KV)],
                 model_name="tiny-minimax-m3")


def minimax_m3_nvfp4(layout: str) -> Stack:
    """MiniMax M3.1 NVFP4: the same stack with NVFP4 page-row pools
    (assembler:2646, 2678): ``MiniMaxM3Nvfp4MainKVPoolHost`` as the anchor,
    ``MiniMaxM3Nvfp4IndexKPoolHost`` as ``PoolName.INDEXER``. The device pool
    requires 128-token pages and 128-wide heads."""
    PoolName, Policy = pool_names(), hit_policies()
    module = "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4"
    main_host = sglang_attr(module, "MiniMaxM3Nvfp4MainKVPoolHost")
    index_host = sglang_attr(module, "MiniMaxM3Nvfp4IndexKPoolHost")
    pool_cls = sglang_attr("sglang.srt.mem_cache.minimax_m3_nvfp4_pool", "MiniMaxM3Nvfp4KVPool")
    sparse = pool_cls(
        size=512, page_size=128, dtype=torch.bfloat16, head_num=1, head_dim=128, idx_head_dim=128,
        dense_layer_ids=[], sparse_layer_ids=[0, 1], disable_value_sparse_layer_ids=[0, 1],
        device="cpu", start_layer=0, end_layer=2,
    )
    main, index = sparse.main_pool, sparse.index_k_pool
    anchor = main_host(
        main.get_device_pool_infos()[0].buffer_info, RATIO, 0, 128, layout, pin_memory=False,
        allocator_type=ALLOCATOR, device_capacity_tokens=main.size, start_layer=main.start_layer,
        end_layer=main.end_layer,
    )
    side = index_host(
        index.get_device_pool_infos()[0].buffer_info, anchor, layout, pin_memory=False,
        allocator_type=ALLOCATOR, start_layer=index.start_layer, end_layer=index.end_layer,
    )
    return Stack("minimax-m3-nvfp4", anchor, [Side(PoolName.INDEXER, side, Policy.ALL_PAGES, source=PoolName.KV)],
                 model_name="tiny-minimax-m3-nvfp4")


# ------------------------------------------------------------ Mamba, QSA


def ple_side_states(capacity: int) -> tuple[torch.Tensor, ...]:
    """PLE's per-slot side states as ``MambaPool.get_device_pool_infos``
    hands them over (memory_pool.py:1090-1094): SGLang's own
    ``ShortConvPool`` and ``NGramPool`` on the CPU, sized to the Mamba
    checkpoint capacity (their ``size + 1`` rows)."""
    module = "sglang.srt.mem_cache.ple_state_pool"
    short_conv = sglang_attr(module, "ShortConvPool")(
        size=capacity - 1, state_shape=(3, 8), layer_ids=[0, 1], dtype=torch.bfloat16, device="cpu"
    )
    ngram = sglang_attr(module, "NGramPool")(size=capacity - 1, context_len=4, eos_token_id=2, device="cpu")
    return tuple(
        buffer for sibling in (short_conv, ngram) for _, buffer, _, _ in sibling.iter_transfer_state_entries()
    )


def mamba_host_pool(layout: str, extra=()):
    """``build_mamba_host_pool`` (assembler:1251-1275) over
    ``pools.mamba_pool``'s Mamba state buffers, in ``layout``."""
    sglang_attr("sglang.srt.mem_cache.pool_host.mamba", "MambaPoolHost")
    sglang_attr("sglang.srt.mem_cache.device_pool_info", "MambaStateBufferInfo")
    pool = mamba_pool(extra=extra)
    if layout == pool.layout:
        return pool
    return type(pool)(pool.buffer_info, RATIO, 0, device_capacity=MAMBA_CAPACITY, pin_memory=False, device="cpu",
                      allocator_type=ALLOCATOR, layout=layout)


def hybrid_anchor(layout: str, page_size: int = 8):
    """The full-attention anchor of a Qwen3-Next-like hybrid, from
    ``build_hybrid_mamba_stack`` (assembler:1278-1412): ``build_kv_host_pool``
    of the declared root pool."""
    return mha_host_pool(mha_device_pool(tokens=32, page_size=page_size, head_num=2, head_dim=16, layer_num=2),
                         layout=layout)


def mamba_with_side_states(layout: str) -> Stack:
    """A Mamba hybrid whose checkpoint slots carry PLE side states
    (``MambaStateBufferInfo.extra_checkpoint_buffers``)."""
    PoolName, Policy = pool_names(), hit_policies()
    sglang_attr("sglang.srt.mem_cache.device_pool_info", "MambaStateBufferInfo")
    mamba = mamba_host_pool(layout, extra=ple_side_states(MAMBA_CAPACITY))
    if not getattr(mamba, "slot_state_buffers", None):
        raise Missing(f"this SGLang ({sglang_version()}) keeps no Mamba slot side states")
    # Mamba: own slots, one state per node under the node's last key
    # (components/mamba.py:916-927), TRAILING_PAGES
    return Stack("mamba-ple", hybrid_anchor(layout), [Side(PoolName.MAMBA, mamba, Policy.TRAILING_PAGES, window=1)],
                 model_name="tiny-mamba-ple")


def mamba_swa(layout: str) -> Stack:
    """KV + SWA + Mamba (``build_hybrid_mamba_swa_stack``,
    assembler:1415-1529): plain MHA pools and a plain Mamba state pool, all
    of kinds sglang-simm already stores; the control case that shows the
    round trip itself passes where the backend takes the pools."""
    PoolName, Policy = pool_names(), hit_policies()
    geometry = dict(tokens=32, page_size=8, head_num=2, head_dim=16)
    full = mha_host_pool(mha_device_pool(layer_num=2, **geometry), layout=layout, pool_label="full")
    swa = mha_host_pool(mha_device_pool(layer_num=1, **geometry), layout=layout, pool_label="swa")
    return Stack("mamba-swa", full, [
        Side(PoolName.SWA, swa, Policy.TRAILING_PAGES),
        Side(PoolName.MAMBA, mamba_host_pool(layout), Policy.TRAILING_PAGES, window=1),
    ], model_name="tiny-mamba-swa")


def qwen4_exp_qsa(layout: str) -> Stack:
    """Qwen4-Exp: ``build_hybrid_mamba_stack`` with a QSA pool
    (assembler:1278-1412): the KV anchor, the Mamba state pool and
    ``QSAIndexerPoolHost(qsa_pool, kv_host_pool)`` (assembler:1379) as
    ``PoolName.INDEXER``, a KV-derived ALL_PAGES sidecar (assembler:2086)."""
    PoolName, Policy = pool_names(), hit_policies()
    qsa_host = sglang_attr("sglang.srt.mem_cache.pool_host.qsa", "QSAIndexerPoolHost")
    qsa_cls = sglang_attr("sglang.srt.mem_cache.qsa_kv_pool", "QSATokenToKVPool")
    # the Mamba state lives in req_to_token_pool; the KV pool only refers to it
    qsa = qsa_cls(
        size=32, dtype=torch.bfloat16, page_size=8, head_num=2, head_dim=16, full_attention_layer_ids=[1, 3],
        device="cpu", mamba_pool=None, qsa_index_kv_heads=1, qsa_index_head_dim=32, qsa_compress_ratio=4,
        qsa_token_topk=2048, num_request_slots=4,
    )
    (root,) = [d for d in qsa.host_pool_decls() if d.pool_name == PoolName.KV]
    anchor = mha_host_pool(root.device_pool, layout=layout)
    index = qsa_host(qsa, anchor, allocator_type=ALLOCATOR)
    return Stack("qwen4-exp", anchor, [
        Side(PoolName.MAMBA, mamba_host_pool(layout), Policy.TRAILING_PAGES, window=1),
        Side(PoolName.INDEXER, index, Policy.ALL_PAGES, source=PoolName.KV),
    ], model_name="tiny-qwen4-exp")


# ------------------------------------------------------------ DeepSeek V4

DSV4_PAGE = 256  # kv_cache_configurator._build_dsv4_kv_pool asserts 256 on GPU
DSV4_HOST_PAGES = 8


def runtime_context():
    """A runtime context of its own for the device pools that read the
    server arguments (DeepSeek V4), so the process-wide one stays as it was."""
    module = "sglang.srt.runtime_context"
    RuntimeContext, ParallelContext = sglang_attr(module, "RuntimeContext"), sglang_attr(module, "ParallelContext")
    use_context = sglang_attr(module, "use_context")
    from sglang.srt.server_args import ServerArgs

    context = RuntimeContext(parallel=ParallelContext())
    context.set_server_args(ServerArgs(model_path="dummy-model", device="cpu"))
    return use_context(context)


def dsv4_device_pool():
    """SGLang's ``DeepSeekV4TokenToKVPool`` on the CPU, FP8 (the V4 layout
    needs a one-byte store dtype), 4 layers: no compression, C4, C128, C4."""
    cls = sglang_attr("sglang.srt.mem_cache.deepseek_v4_memory_pool", "DeepSeekV4TokenToKVPool")
    with runtime_context():
        return cls(
            max_num_reqs=2, swa_size=2 * DSV4_PAGE, c4_size=2 * DSV4_PAGE // 4, c128_size=8,
            c4_state_pool_size=64, c128_state_pool_size=64, page_size=DSV4_PAGE, swa_page_size=DSV4_PAGE,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
            qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4, device="cpu",
            enable_memory_saver=False, compression_ratios=[0, 4, 128, 4], start_layer=0, end_layer=4,
        )


def deepseek_v4(layout: str) -> Stack:
    """``build_deepseek_v4_hicache_stack`` (assembler:946-1248) and its
    sidecar specs (``_DeepSeekV4Strategy.build``, assembler:1967-2000):

    * ``LogicalHostPool`` as the KV anchor: page-aligned FULL slots, no bytes;
    * SWA: ``DeepSeekV4PagedHostPool`` over the SWA KV, own slots in
      ``swa_page_size`` pages, TRAILING_PAGES;
    * C4, the C4 indexer, C128: ``DeepSeekV4PagedHostPool`` page rows indexed
      by the anchor's FULL token slots (KV-derived, ALL_PAGES);
    * the C4 compress states: ``DeepSeekV4StateHostPool``, indexed by SWA's
      slots (SWA-derived, TRAILING_PAGES)."""
    PoolName, Policy = pool_names(), hit_policies()
    module = "sglang.srt.mem_cache.memory_pool_host"
    logical = sglang_attr(module, "LogicalHostPool")
    paged = sglang_attr(module, "DeepSeekV4PagedHostPool")
    state = sglang_attr(module, "DeepSeekV4StateHostPool")
    kv = dsv4_device_pool()
    maps = _assembler("_resolve_deepseek_v4_layer_mappings")(kv)
    aligned_only = _assembler("_dsv4_page_aligned_only")
    page = DSV4_PAGE
    # _deepseek_v4_num_host_pages: FULL, SWA and C128 host pages, here alike
    pages = swa_pages = c128_pages = DSV4_HOST_PAGES

    def paged_pool(name, buffers, item_bytes, n, slot_page_size, page_aligned_only):
        return paged(pool_name=str(name), device_buffers=buffers, item_bytes=item_bytes, num_host_pages=n,
                     slot_page_size=slot_page_size, layout=layout, pin_memory=False,
                     allocator_type=ALLOCATOR, page_aligned_only=page_aligned_only)

    def state_pool(name, state_pools):
        return state(pool_name=str(name), state_pools=state_pools, num_host_pages=swa_pages,
                     swa_page_size=kv.swa_page_size, layout=layout, pin_memory=False, allocator_type=ALLOCATOR)

    anchor = logical(pages * page, page, layout=layout)
    sides = [Side(PoolName.SWA, paged_pool(
        PoolName.SWA, [*kv.swa_kv_pool.kv_buffer], kv.swa_kv_pool.bytes_per_page_padded, swa_pages,
        kv.swa_page_size, aligned_only(kv.swa_kv_pool)), Policy.TRAILING_PAGES)]
    c4_buffers, c4_item = _assembler("_dsv4_compressed_region_buffers")(kv, 4)
    sides.append(Side(PoolName.DEEPSEEK_V4_C4, paged_pool(
        PoolName.DEEPSEEK_V4_C4, c4_buffers, c4_item, pages, page, aligned_only(kv.c4_kv_pool)),
        Policy.ALL_PAGES, source=PoolName.KV))
    for region in _assembler("_dsv4_indexer_regions")(kv, page):
        sides.append(Side(region.name, paged_pool(
            region.name, region.device_buffers, region.item_bytes, pages, region.slot_page_size,
            region.page_aligned_only), Policy.ALL_PAGES, source=PoolName.KV))
    for name, pools in ((PoolName.DEEPSEEK_V4_C4_STATE, kv.compress_state_pools),
                        (PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, kv.indexer_compress_state_pools)):
        sides.append(Side(name, state_pool(name, [pools[layer] for layer in maps.c4_state_global_layers]),
                          Policy.TRAILING_PAGES, source=PoolName.SWA))
    c128_buffers, c128_item = _assembler("_dsv4_compressed_region_buffers")(kv, 128)
    c128_page = getattr(kv.c128_kv_pool, "kernel_page_size", page)
    sides.append(Side(PoolName.DEEPSEEK_V4_C128, paged_pool(
        PoolName.DEEPSEEK_V4_C128, c128_buffers, c128_item, c128_pages, c128_page, aligned_only(kv.c128_kv_pool)),
        Policy.ALL_PAGES, source=PoolName.KV))
    # DeepSeek V4 is rank-replicated, like MLA (managers/cache_controller.py:771-775)
    return Stack("deepseek-v4", anchor, sides, is_mla=True, model_name="tiny-deepseek-v4")


# ------------------------------------------------------------------ MXFP8


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the block, then as it was."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def mxfp8_host_pool():
    """``MHATokenToKVPoolMXFP8Host`` over SGLang's CPU
    ``MHATokenToKVPoolMXFP8`` (128-token pages: the interleaved scale
    layout), the class ``get_mha_host_pool_cls`` picks for it. Its
    constructor insists on the staged CUDA/HIP write-back kernel, which a CPU
    lacks: that one gate is opened while it runs (the staging buffers it
    would size are CPU tensors), and closed again; the pool's buffers and
    storage methods are SGLang's."""
    host_cls = sglang_attr("sglang.srt.mem_cache.pool_host.mha_mxfp8", "MHATokenToKVPoolMXFP8Host")
    device_cls = sglang_attr("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPoolMXFP8")
    from sglang.srt.mem_cache.pool_host import mha as mha_host
    from sglang.srt.mem_cache.pool_host import mha_mxfp8

    device = mha_device_pool(tokens=256, page_size=128, head_num=1, head_dim=32, layer_num=2, cls=device_cls)

    def staging(self, buffer_info, write_back_staging):
        self.can_use_write_back_jit = True
        self.staging_page_capacity = min(self.page_num, 2)
        self.staging_token_capacity = self.staging_page_capacity * self.page_size
        self.staging_k_buffer = self.staging_v_buffer = None

    with _patched(mha_host.MHATokenToKVPoolHost, "_init_write_back_staging_buffers", staging), \
            _patched(mha_mxfp8, "can_use_write_back_jit_kernel", lambda **_: True):
        pool = mha_host_pool(device, layout="page_first")
    if type(pool) is not host_cls:
        raise TypeError(f"get_mha_host_pool_cls picked {type(pool).__name__}, not {host_cls.__name__}")
    return pool


# ---------------------------------------------------------------- MLA + draft


def mla_with_mha_draft(tp_rank: int, layout: str = "page_first") -> Stack:
    """An MLA model (one rank of TP 2) with an MHA draft model: the MLA KV
    anchor of ``build_kv_only_group`` and the draft sidecar of
    ``build_full_draft_pools`` (assembler:1619-1710): the draft's own host
    pool with the anchor's token capacity, ``PoolName.DRAFT``, KV-derived,
    ALL_PAGES, registered after the group (kv_cache_builder.py:125-159)."""
    PoolName, Policy = pool_names(), hit_policies()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    mla = MLATokenToKVPool(size=32, page_size=4, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16,
                           layer_num=2, device="cpu", enable_memory_saver=False)
    anchor = mla_host_pool(mla, layout=layout)
    # one KV head of the draft's two on this rank: the draft's KV is TP-sharded
    draft_device = mha_device_pool(tokens=32, page_size=4, head_num=1, head_dim=16, layer_num=1)
    capacity = anchor.logical_size
    draft = mha_host_pool(draft_device, layout=layout, pool_label="draft", host_token_capacity=capacity,
                          ratio=capacity / draft_device.size)
    return Stack(f"mla-draft-r{tp_rank}", anchor, [
        Side(PoolName.DRAFT, draft, Policy.ALL_PAGES, source=PoolName.KV, late=True)
    ], is_mla=True, model_name="tiny-mla-eagle")


def should_backup(stack: Stack, *, writer: bool, name) -> bool:
    """SGLang's own ``HybridCacheController.should_backup`` for this
    backend on a rank that is (not) the storage writer."""
    from types import SimpleNamespace as NS

    controller = sglang_attr("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController")
    entries = {s.name: NS(host_pool=s.pool) for s in stack.sides}
    me = NS(backup_skip=not writer, storage_backend_type="simm", mem_pool_host=NS(entry_map=entries))
    return controller.should_backup(me, transfer(name, keys=[]))



# ------------------------------------------------------------ every stack


#: every stack the harness builds, label -> builder(layout)
STACKS: dict[str, Callable[[str], Stack]] = {
    "mimo-v2": mimo_v2,  # AsymmetricMHATokenToKVPoolHost anchor + SWA
    "minimax-m3": minimax_m3,  # MHATokenToKOnlyPoolHost indexer
    "minimax-m3-nvfp4": minimax_m3_nvfp4,  # NVFP4 main + index page rows
    "qwen4-exp": qwen4_exp_qsa,  # QSAIndexerPoolHost + Mamba
    "mamba-ple": mamba_with_side_states,  # MambaPoolHost with extra_checkpoint_buffers
    "deepseek-v4": deepseek_v4,  # LogicalHostPool + V4 paged and state pools
    "mamba-swa": mamba_swa,  # plain MHA, SWA and Mamba pools: the harness's control
    "mla-draft-tp1": lambda layout: mla_with_mha_draft(0, layout),  # the draft registered late
}


def requirements() -> None:
    """What replaying the controller needs of SGLang besides the pools
    (v2 transfers, hit policies, the hybrid controller's ``should_backup``):
    :class:`Missing` where the release lacks it."""
    pool_names()
    hit_policies()
    sglang_attr("sglang.srt.mem_cache.hicache_storage", "PoolTransfer")
    sglang_attr("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController")


def round_trip(attach, stack: Stack, **fields) -> dict[str, Any]:
    """One stack driven as SGLang's hybrid controller drives it, for the
    compat probe: attached (:func:`attach_stack`), three pages of every pool
    backed up as two nodes (:func:`backup`), the storage hit query
    (``batch_exists_v2`` with the controller's PREFETCH transfers), the host
    memory scrambled, the hit read back into other slots (:func:`prefetch`)
    and compared byte for byte through each pool's ``get_page_buffer_meta``
    (a window-1 pool: the hit's last node state). ``{"stored": every pool's
    pages written, "bytes_equal": every pool's pages read and as written,
    "kv_hit": pages the hit query found}``; an attach the backend refuses
    raises ``UnsupportedPoolError``."""
    backend = attach_stack(attach, stack, **fields)
    p = plan(stack)
    scramble_all(stack, 1)
    want = snapshot(stack, p, "src")
    stored = backup(backend, stack, p)
    kv_hit = int(backend.batch_exists_v2(p.keys, queries(stack)).kv_hit_pages)
    scramble_all(stack, 2)
    got = prefetch(backend, stack, p)
    have = snapshot(stack, p, "dst")
    equal = set(got) == set(stack.pools()) and all(all(ok) and ok for ok in got.values())
    for name in stack.pools():
        side = next((s for s in stack.sides if s.name == name), None)
        pages = [-1] if side is not None and side.window == 1 else range(len(p.keys))
        equal = equal and all(have[name][i] == want[name][i] for i in pages)
    return {
        "stored": set(stored) == set(stack.pools()) and all(all(ok) and ok for ok in stored.values()),
        "bytes_equal": bool(equal),
        "kv_hit": kv_hit,
    }
