"""Helpers over real SGLang host pools, shared by the test modules."""

from __future__ import annotations

import dataclasses

import torch

from sglang_simm_dev.hybrid_pools import hashes  # noqa: F401  (the page keys every test module uses)


def tiny(**changes):
    from sglang_simm_dev.pools import PRESETS

    return dataclasses.replace(PRESETS["tiny"], **changes)


def tiny_mla(**changes):
    from sglang_simm_dev.pools import ModelGeometry

    base = ModelGeometry("tiny-mla", 2, 1, 48, 4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16)
    return dataclasses.replace(base, **changes)


def fill_random(host, seed: int) -> None:
    buf = host.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def page(host, p: int) -> torch.Tensor:
    """Page ``p``'s bytes through SGLang's own accessor (layout-independent)."""
    return host.get_data_page(p * host.page_size, flat=True).contiguous().view(torch.uint8).clone()


def slots(host, first_page: int, n: int) -> torch.Tensor:
    ps = host.page_size
    return torch.arange(first_page * ps, (first_page + n) * ps, dtype=torch.int64)


def raw(host) -> torch.Tensor:
    return host.kv_buffer.view(-1).view(torch.uint8).clone()


def region_count() -> int:
    """Host memory regions the local store's client has bound, all backends
    of this process together (its registration table: a test of ours may
    look inside the store)."""
    from sglang_simm.local_store import _kv as _client

    return len(_client._regions)
