"""The copying path's batches: pages as flat tensors, through client-owned blocks.

SGLang takes its copying path (``batch_get``, ``batch_set``) for the
``dynamic`` route without ``interface_v1``: each page is one flat tensor,
its objects back to back in address order (``PoolBinding.flat_offsets``),
outside the host pool's registered memory, so the objects move through
blocks the client allocates.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglang_simm.binding import Batch, PoolBinding
from sglang_simm.client import KVClient


def read_batch(client: KVClient, b: PoolBinding, keys: Sequence[Any], targets: Sequence[Any]) -> tuple[Batch, list[Any]]:
    """The pages to read (those whose target is a flat CPU tensor of the
    page's size), with a client block per object to read into: the batch,
    its views being the blocks', and the blocks."""
    found = b.lookup(keys, wanted=[_fits_flat(t, b.page_bytes) for t in targets])
    blocks = [client.allocate(size) for size in b.sizes_list * len(found.rows)]
    return found._replace(views=[blk.view() for blk in blocks]), blocks


def copy_out(batch: Batch, blocks: list[Any], pages_read: list[bool], targets: Sequence[Any]) -> list[Any]:
    """Each page read (``pages_read``) copied from its blocks into its
    target: the targets filled, None for every other page."""
    b = batch.binding
    out: list[Any] = [None] * batch.n
    offsets, sizes = b.flat_offsets.tolist(), b.sizes_list
    for row, page in enumerate(batch.rows):
        if not pages_read[page]:
            continue
        target = targets[page]
        flat = (target.view(torch.uint8) if target.dtype != torch.uint8 else target).reshape(-1)
        for part, blk in enumerate(blocks[row * b.parts:(row + 1) * b.parts]):
            flat[offsets[part]:offsets[part] + sizes[part]].copy_(blk.as_ref())
        out[page] = target
    return out


def write_batch(client: KVClient, b: PoolBinding, keys: Sequence[Any], values: Sequence[Any]) -> Batch | None:
    """Every page to write, its objects staged (``Staged``); None unless
    every page key is usable and every value a flat CPU tensor of the
    page's size (SGLang's ``batch_set`` answers one bool for the batch)."""
    if not all(_fits_flat(v, b.page_bytes) for v in values):
        return None
    found = b.lookup(keys)
    if len(found.rows) != found.n:
        return None
    return found._replace(views=Staged(client, b, list(values)))


class Staged:
    """The objects of flat pages as views: object ``i`` is copied out of its
    flat page into a client-owned block when first asked for, so only the
    objects actually put are copied."""

    def __init__(self, client: KVClient, b: PoolBinding, pages: list[torch.Tensor]):
        self._client = client
        self._parts = b.parts
        self._sizes = b.sizes_list
        self._offsets = b.flat_offsets.tolist()
        self._pages = pages
        self._blocks: list[Any] = []  # held until the put is done

    def __len__(self) -> int:
        return len(self._pages) * self._parts

    def __getitem__(self, i: int) -> Any:
        page, part = divmod(i, self._parts)
        src = self._pages[page].contiguous().view(torch.uint8).reshape(-1)
        size, offset = self._sizes[part], self._offsets[part]
        block = self._client.allocate(size)
        block.as_ref().copy_(src[offset:offset + size])
        self._blocks.append(block)
        return block.view()


def _fits_flat(t: Any, nbytes: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() * t.element_size() == nbytes
    )
