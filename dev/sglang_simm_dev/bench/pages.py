"""Page keys, host indices and pool contents for the bench."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch


def page_keys(n: int, salt: str) -> list[str]:
    """SGLang-like page keys: sha256 hex digests."""
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def host_indices(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """The token slots of ``pages``, as SGLang's controller hands them over."""
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (compares bit patterns: random bf16 has NaNs)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fill_pool(pool: Any, seed: int = 0) -> None:
    """Distinct bytes everywhere, so a read of the wrong page shows."""
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    n8 = flat.numel() // 8
    words = flat[: n8 * 8].view(torch.int64)
    torch.arange(n8, out=words)
    words.mul_(0x9E3779B97F4A7C15 - (1 << 64)).add_(seed)


class KeyRing:
    """Distinct page keys handed out batch by batch, as serving meets them:
    each batch new. The ring wraps around only after more keys than a key
    cache holds (make it at least twice a cache's length plus a batch), so
    no batch is ever found in a cache filled by an earlier one.
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.pos = 0

    def _start(self, pos: int, n: int) -> int:
        if n > len(self.keys):
            raise ValueError(f"a batch of {n} keys from a ring of {len(self.keys)}")
        return 0 if pos + n > len(self.keys) else pos

    def take(self, n: int) -> list[str]:
        """The next batch of ``n`` keys."""
        start = self._start(self.pos, n)
        self.pos = start + n
        return self.keys[start:start + n]

    def peek(self, count: int, n: int) -> list[list[str]]:
        """The next ``count`` batches ``take(n)`` will hand out, not taken."""
        out, pos = [], self.pos
        for _ in range(count):
            start = self._start(pos, n)
            out.append(self.keys[start:start + n])
            pos = start + n
        return out
