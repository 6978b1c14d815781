"""Hybrid models: SGLang's v2 pool-transfer interface, the parts without I/O.

Hybrid models (Mamba, sliding-window attention, DSA indexers, speculative
drafts) keep state in host pools beside the KV pool, handed to the backend
through ``register_mem_host_pool_v2(pool, name)`` and moved with per-pool
``PoolTransfer`` lists; the KV pages still move through v1.

Every side pool's objects are stored under KV page keys (a Mamba state
under its radix node's last page, an SWA window under the pages it ends on,
an indexer or draft under every page), so the hit query looks each pool up
under the KV page keys; a transfer's own ``keys`` there are placeholders
whose count is the trailing window.

This module holds the hit policies (pure functions over "does the pool hold
an object for KV page i", following SGLang's own ``file`` and Mooncake
backends exactly) and the description of a side pool's memory; the backend
does the I/O. BLOCK_GROUPS leaves the keys of a group unspecified, so a
query that carries it is answered as a miss (``unsupported_policy_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from sglang_simm.errors import UnsupportedPoolError
from sglang_simm.geometry import SUPPORTED_LAYOUTS

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"
#: Hit policies this backend evaluates.
SUPPORTED_POLICIES = (ALL_PAGES, TRAILING_PAGES)

#: The anchor's name in ``register_mem_host_pool_v2`` and in hit results.
KV = "kv"


def pool_name(name: Any) -> str:
    """A pool name as a plain string (``PoolName.MAMBA`` -> ``"mamba"``;
    SGLang 0.5.10's ``str()`` of the enum is ``"PoolName.MAMBA"``)."""
    return str(getattr(name, "value", name))


def policy_name(policy: Any) -> str:
    """``PoolHitPolicy.TRAILING_PAGES`` (or its value) -> ``"trailing_pages"``."""
    return str(getattr(policy, "value", policy)).lower()


def trailing_window(keys: Sequence[Any] | None) -> int:
    """The pages a TRAILING_PAGES pool needs before a stop point: the number
    of keys its query transfer carries, at least 1 (SGLang's rule)."""
    return max(1, len(keys) if keys else 1)


def unsupported_policy_reason(policy: Any) -> str | None:
    """Why a hit policy cannot be evaluated, or None."""
    value = policy_name(policy)
    if value in SUPPORTED_POLICIES:
        return None
    if value == BLOCK_GROUPS:
        return (
            "hit policy BLOCK_GROUPS is not supported: no SGLang release produces it and "
            "it does not say which keys a block's group is stored under (SGLang's file "
            "and Mooncake backends refuse it too); answering the query as a miss"
        )
    return f"unknown hit policy {value!r}; answering the query as a miss"


def _as_flags(page_exists: Sequence[bool] | np.ndarray) -> np.ndarray:
    return np.asarray(page_exists, dtype=bool).reshape(-1)


def all_pages_stops(page_exists: Sequence[bool] | np.ndarray) -> tuple[int, np.ndarray]:
    """ALL_PAGES over ``n`` KV pages: ``(boundary, mask)`` where ``mask[p-1]``
    says whether prefix length ``p`` (1..n) is restorable and ``boundary`` is
    the number of leading pages the pool holds."""
    flags = _as_flags(page_exists)
    boundary = int(flags.size if flags.all() else np.argmin(flags))
    return boundary, np.arange(flags.size) < boundary


def trailing_pages_stops(page_exists: Sequence[bool] | np.ndarray, window: int) -> tuple[int, np.ndarray]:
    """TRAILING_PAGES with ``window`` pages: prefix length ``p`` is
    restorable iff pages ``[max(0, p - window), p)`` all exist.
    ``boundary`` is the longest restorable ``p`` (0: none)."""
    flags = _as_flags(page_exists)
    window = max(1, int(window))
    idx = np.arange(flags.size)
    # run[i]: how many consecutive pages ending at i exist
    last_missing = np.maximum.accumulate(np.where(flags, -1, idx))
    run = idx - last_missing
    mask = run >= np.minimum(window, idx + 1)
    hits = np.flatnonzero(mask)
    return (int(hits[-1]) + 1 if hits.size else 0), mask


@dataclass(frozen=True)
class PoolQuery:
    """One extra pool of a hit query, already looked up: ``page_exists[i]``,
    the pool holds an object for KV page ``i`` (over the KV hit only)."""

    name: Hashable
    policy: str
    window: int
    page_exists: np.ndarray


@dataclass(frozen=True)
class HitVerdict:
    """What ``batch_exists_v2`` answers (SGLang's ``PoolTransferResult``)."""

    #: the longest prefix, in pages, that every pool can restore
    kv_hit_pages: int
    #: each pool's own boundary, the KV pool's under ``"kv"``; zeros omitted
    pool_hit_pages: dict[Hashable, int]
    #: every restorable prefix length, ascending (may have holes)
    restorable_prefix_pages: list[int]


def fold_hits(kv_pages: int, pools: Sequence[PoolQuery], *, kv_name: Hashable = KV) -> HitVerdict:
    """Intersect the restorable prefix lengths of the KV pool (``1..kv_pages``)
    and of every extra pool, in order, stopping once nothing is restorable.
    Raises ValueError on a policy outside ``SUPPORTED_POLICIES``."""
    kv_pages = max(0, int(kv_pages))
    hits: dict[Hashable, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = np.ones(kv_pages, dtype=bool)
    for pool in pools:
        if not restorable.any():
            break
        flags = _as_flags(pool.page_exists)
        if flags.size != kv_pages:
            raise ValueError(f"pool {pool.name!r}: {flags.size} page flags for {kv_pages} KV pages")
        policy = policy_name(pool.policy)
        if policy == ALL_PAGES:
            boundary, mask = all_pages_stops(flags)
        elif policy == TRAILING_PAGES:
            boundary, mask = trailing_pages_stops(flags, pool.window)
        else:
            raise ValueError(unsupported_policy_reason(policy))
        if boundary:
            hits[pool.name] = boundary
        restorable &= mask
    stops = (np.flatnonzero(restorable) + 1).tolist()
    return HitVerdict(stops[-1] if stops else 0, hits, stops)


def miss() -> HitVerdict:
    """The safe answer: nothing restorable, no pool verdict."""
    return HitVerdict(0, {}, [])


def to_pool_transfer_result(verdict: HitVerdict) -> Any:
    """SGLang's ``PoolTransferResult`` (``restorable_prefix_pages`` exists
    from 0.5.19; older releases get the KV hit and per-pool pages only)."""
    import dataclasses

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    hits = {(PoolName.KV if k == KV else k): v for k, v in verdict.pool_hit_pages.items()}
    stops = {"restorable_prefix_pages": list(verdict.restorable_prefix_pages)}
    if "restorable_prefix_pages" not in {f.name for f in dataclasses.fields(PoolTransferResult)}:
        stops = {}
    return PoolTransferResult(kv_hit_pages=verdict.kv_hit_pages, extra_pool_hit_pages=hits, **stops)


@dataclass(frozen=True)
class SidePoolLayout:
    """How a side pool's pages are registered and named."""

    #: what the pool is, for logs: "mamba", "mha", "mla", "indexer" or
    #: "object" (any other page-addressable pool)
    kind: str
    #: host tensors to register (an object's region is the one holding it)
    regions: tuple[Any, ...]
    #: object names in page order; None: the KV naming (``.k``/``.v`` for
    #: MHA, ``.kv`` for MLA)
    part_names: tuple[str, ...] | None
    #: objects identical on every TP rank (MLA-like): keys carry no TP rank
    replicated: bool
    #: the pool's page description (``get_page_buffer_meta``'s shape); the
    #: pool's own method unless it leaves objects out (``_mamba_meta``)
    meta: Any = None


def _host_tensors(pool: Any) -> list[Any]:
    """The pool's host memory: ``kv_buffer`` when it is one tensor, else
    ``get_hybrid_pool_buffer()`` (Mamba, DSA indexer), else a ``kv_buffer``
    list; empty tensors (a conv-only model's temporal state) dropped."""
    import torch

    buffer = getattr(pool, "kv_buffer", None)
    if isinstance(buffer, torch.Tensor):
        candidates = [buffer]
    else:
        get = getattr(pool, "get_hybrid_pool_buffer", None)
        candidates = None
        if callable(get):
            try:
                candidates = list(get())
            except Exception as exc:
                raise UnsupportedPoolError(
                    f"{type(pool).__name__}.get_hybrid_pool_buffer() failed: {type(exc).__name__}: {exc}"
                ) from exc
        if candidates is None and isinstance(buffer, (list, tuple)):
            candidates = list(buffer)
    if not candidates:
        raise UnsupportedPoolError(
            f"{type(pool).__name__} has no host buffers (a logical or dummy pool); "
            "sglang-simm stores pools that hold their pages in host memory"
        )
    tensors = []
    for t in candidates:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise UnsupportedPoolError(
                f"{type(pool).__name__} holds a buffer that is not a host tensor "
                f"({type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' on ' + str(t.device)})"
            )
        if t.numel() > 0:
            tensors.append(t)
    if not tensors:
        raise UnsupportedPoolError(f"{type(pool).__name__} has only empty host buffers")
    return tensors


def _parts_per_page(pool: Any, meta: Any) -> int:
    import torch

    page_size = int(pool.page_size)
    ptrs, sizes = meta(torch.arange(0, page_size, dtype=torch.int64))
    if len(ptrs) != len(sizes) or not ptrs:
        raise UnsupportedPoolError(f"{type(pool).__name__} reports no objects for a page")
    return len(ptrs)


class _WithoutSideStates:
    """A Mamba host pool seen without its per-slot side states, so SGLang's
    own ``get_page_buffer_meta`` describes the temporal and conv objects
    (it refuses a pool with side states, which it does not describe)."""

    slot_state_device_tensors = ()

    def __init__(self, pool: Any):
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _mamba_meta(pool: Any) -> Any:
    """The page description of a Mamba pool with per-slot side states
    (``extra_checkpoint_buffers``): SGLang's own objects of each page, then
    one per side state: ``page_size`` rows from the page's first slot (the
    slot is axis 0 of each side-state buffer), the bytes SGLang's own
    whole-page path moves for it."""
    states = list(pool.slot_state_buffers)
    rows = [t[0].numel() * t.element_size() for t in states]
    plain = _WithoutSideStates(pool)
    own = type(pool).get_page_buffer_meta
    page_size = int(pool.page_size)

    def meta(indices: Any) -> tuple[list[int], list[int]]:
        ptrs, sizes = own(plain, indices)
        firsts = [int(i) for i in indices.tolist()[::page_size]]
        per = len(ptrs) // max(1, len(firsts))
        out_p: list[int] = []
        out_s: list[int] = []
        for n, first in enumerate(firsts):
            out_p += ptrs[n * per:(n + 1) * per]
            out_s += sizes[n * per:(n + 1) * per]
            for t, row in zip(states, rows):
                out_p.append(t.data_ptr() + first * row)
                out_s.append(page_size * row)
        return out_p, out_s

    return meta


def describe_side_pool(pool: Any, name: str, *, model_is_mla: bool) -> SidePoolLayout:
    """Check a side pool and say how to store it; raise UnsupportedPoolError
    (failing the attach) on one this backend cannot store zero-copy. Pools
    this module knows are named by what they hold; any other page-addressable
    pool is stored as its objects by position."""
    kind_name = type(pool).__name__
    if not callable(getattr(pool, "get_page_buffer_meta", None)):
        raise UnsupportedPoolError(
            f"hybrid pool {name!r} ({kind_name}) has no get_page_buffer_meta, so its pages "
            "cannot be moved zero-copy; sglang-simm stores pools SGLang describes page by page"
        )
    try:
        page_size = int(pool.page_size)
        int(pool.size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise UnsupportedPoolError(f"hybrid pool {name!r} ({kind_name}) has no page_size/size") from exc
    if page_size < 1:
        raise UnsupportedPoolError(f"hybrid pool {name!r} ({kind_name}) has page_size {page_size}")
    layout = getattr(pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise UnsupportedPoolError(
            f"hybrid pool {name!r} ({kind_name}) uses layout {layout!r}; sglang-simm supports "
            f"{', '.join(SUPPORTED_LAYOUTS)}: start SGLang with --hicache-mem-layout page_first"
        )
    regions = tuple(_host_tensors(pool))
    is_mamba = hasattr(pool, "temporal_buffer") and hasattr(pool, "conv_buffer")
    meta = _mamba_meta(pool) if is_mamba and getattr(pool, "slot_state_device_tensors", None) else None
    try:
        parts = _parts_per_page(pool, meta or pool.get_page_buffer_meta)
    except UnsupportedPoolError:
        raise
    except Exception as exc:
        raise UnsupportedPoolError(
            f"cannot read the page layout of hybrid pool {name!r} ({kind_name}, layout "
            f"{layout!r}): {type(exc).__name__}: {exc}"
        ) from exc

    if is_mamba:
        names = []
        if int(getattr(pool, "temporal_state_elem_size", 1) or 0) > 0:
            names.append("temporal")
        names += [f"conv{i}" for i in range(len(pool.conv_buffer))]
        names += [f"state{i}" for i in range(len(getattr(pool, "slot_state_buffers", ()) if meta else ()))]
        if len(names) != parts:
            raise UnsupportedPoolError(
                f"hybrid pool {name!r} ({kind_name}) reports {parts} objects per state slot, "
                f"expected {len(names)} ({', '.join(names)})"
            )
        # Mamba/linear-attention state is sharded by TP even beside MLA KV.
        return SidePoolLayout("mamba", regions, tuple(names), replicated=False, meta=meta)
    is_mla_pool = hasattr(pool, "kv_lora_rank") or hasattr(pool, "kv_cache_dim")
    if is_mla_pool and parts == 1:
        return SidePoolLayout("mla", regions, None, replicated=True)
    if not is_mla_pool and hasattr(pool, "head_num") and parts == 2:
        return SidePoolLayout("mha", regions, None, replicated=False)
    if _is_dsa_indexer(pool) and parts == 1:
        # DeepSeek V3.2's index keys ride on the MLA KV pages: one object per
        # page, replicated exactly when the model's KV is.
        return SidePoolLayout("indexer", regions, ("o0",), replicated=bool(model_is_mla))
    # Any other page-addressable pool, its objects by position. Beside a
    # rank-replicated model SGLang writes side pools on its writer rank only
    # and every rank loads those bytes (HybridCacheController.should_backup),
    # so such a pool is keyed without the rank, as SGLang's own backends key
    # it; the TP-sharded exceptions (MHA heads, Mamba state) are told apart
    # above. Elsewhere every rank writes its own, keyed by rank.
    names = tuple(f"o{i}" for i in range(parts))
    return SidePoolLayout("object", regions, names, replicated=bool(model_is_mla))


def writer_only_reason(
    layout: SidePoolLayout, name: str, kind_name: str, *, model_is_mla: bool, tp_size: int, dcp_size: int = 1
) -> str | None:
    """Why a side pool is left out of this deployment's L3, or None.

    Beside a rank-replicated (MLA) model, SGLang writes to storage only on
    its writer ranks (``HiCacheStorageConfig.is_storage_writer``) and backs
    a side pool up on the others only when it is Mamba state
    (``HybridCacheController.should_backup``). A TP-sharded pool there (an
    MHA draft of an MLA target) would be written in rank 0's heads alone:
    the other ranks' hit query would always miss, and SGLang's MIN
    all-reduce of the hit would void every prefetch on every rank. Such a
    pool is left out instead (no memory bound, no verdict in hits and
    transfers), and the target's pages are stored as usual.
    """
    if not model_is_mla or layout.replicated or layout.kind == "mamba" or tp_size <= max(1, dcp_size):
        return None
    return (
        f"hybrid pool {name!r} ({kind_name}) holds TP-sharded {layout.kind.upper()} pages beside an "
        f"MLA model at TP {tp_size}: SGLang backs such a pool up only on the MLA writer rank while its "
        f"bytes differ per rank (a draft model's KV heads are sharded across TP), so sglang-simm leaves "
        f"it out of L3. The model's own pages are stored and restored as usual; a prefix restored "
        f"from L3 runs the draft on stale draft KV for those tokens, which lowers speculative "
        f"acceptance (the target model still verifies every token). To store the draft too, use an "
        f"MLA draft (the model's own NextN/MTP layers) or run attention at TP 1 "
        f"(--enable-dp-attention with --dp-size equal to --tp-size)"
    )


def _is_dsa_indexer(pool: Any) -> bool:
    """SGLang's ``DSAIndexerPoolHost`` (DeepSeek V3.2), by its attributes."""
    return hasattr(pool, "index_k_with_scale_buffer") and hasattr(pool, "indexer_page_stride_size")
