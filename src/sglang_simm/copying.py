"""SGLang's copying path (``get``, ``set``, ``batch_get``, ``batch_set``, ``exists``).

SGLang takes it for the ``dynamic`` route without ``interface_v1``: each
page arrives or leaves as one flat tensor, its objects back to back in
address order (``PoolBinding.flat_offsets``), copied through client-owned
blocks. Writes ask ``mexists`` first here: an object already stored then
costs no copy into a block and no transfer. Never raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglang_simm.binding import PoolBinding
from sglang_simm.client import KVClient
from sglang_simm.inflight import Call
from sglang_simm.transfer import ALREADY_EXISTS, Batch, _now


class CopyingPath:
    """``HiCacheSiMM``'s copying path."""

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Fill each flat page tensor, or None on a miss."""
        n = len(keys) if keys is not None else 0
        targets = list(target_locations) if target_locations is not None else []
        with Call(self._fault, "batch_get") as call:
            b = self._use_kv(call, "batch_get")
            if b is None or len(targets) != n:
                if b is not None:
                    self._log("legacy_args", "SiMM: batch_get needs one target tensor per key")
                return [None] * n
            out: list[Any] = [None] * n
            pages, obj_keys = b.page_object_keys(keys)
            blocks = [self.client.allocate(s) for s in b.sizes_list * len(pages)]
            views = [blk.view() for blk in blocks]
            codes = np.asarray(self.client.mget(obj_keys, views), dtype=np.int64)
            if codes.size != len(obj_keys):
                raise RuntimeError(f"mget answered {codes.size} results for {len(obj_keys)} objects")
            ok = (codes.reshape(-1, b.parts) == b.sizes[None, :]).all(axis=1)
            if not ok.all():
                ok &= ~self._read_faults(Batch(b, n, pages, obj_keys, views, None), codes)
            offsets, sizes = b.flat_offsets.tolist(), b.sizes_list
            for row, page in enumerate(pages.tolist()):
                target = targets[page]
                if not ok[row] or not _fits_flat(target, b.page_bytes):
                    continue
                flat = target.view(torch.uint8) if target.dtype != torch.uint8 else target
                flat = flat.reshape(-1)
                for part, blk in enumerate(blocks[row * b.parts:(row + 1) * b.parts]):
                    flat[offsets[part]:offsets[part] + sizes[part]].copy_(blk.as_ref())
                out[page] = target
            hits = sum(x is not None for x in out)
            self.counters.record_get(hits, n - hits, hits * b.page_bytes, 0.0, b.page_bytes)
            return out
        return [None] * n

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store flat page tensors; True if all stored. Only the objects not
        stored yet are copied and put."""
        n = len(keys) if keys is not None else 0
        vals = list(values) if values is not None else []
        if n == 0:
            return False
        with Call(self._fault, "batch_set") as call:
            b = self._use_kv(call, "batch_set")
            if b is None or len(vals) != n:
                if b is not None:
                    self._log("legacy_args", "SiMM: batch_set needs one value per key")
                return False
            pages, obj_keys = b.page_object_keys(keys)
            if len(pages) != n or not all(_fits_flat(v, b.page_bytes) for v in vals):
                return False
            staged = _Staged(self.client, b, vals)
            t0 = _now()
            present = self.client.mexists(obj_keys)
            if len(present) != len(obj_keys):
                raise RuntimeError(f"mexists answered {len(present)} results for {len(obj_keys)} keys")
            codes = np.where(np.asarray(present, dtype=bool), ALREADY_EXISTS, 0).astype(np.int64)
            missing = np.flatnonzero(codes == 0).tolist()
            if missing:
                put = self.client.mput([obj_keys[i] for i in missing], [staged[i] for i in missing])
                if len(put) != len(missing):
                    raise RuntimeError(f"mput answered {len(put)} results for {len(missing)} objects")
                codes[missing] = np.asarray(put, dtype=np.int64)
            (row,) = self._put_rows([Batch(b, n, None, obj_keys, staged, None)], codes, _now() - t0)
            return all(row)
        return False


class _Staged:
    """The copying path's objects as views: object ``i`` is copied out of
    its flat page into a client-owned block when first asked for, so only
    the objects not stored yet are copied."""

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
