"""Helpers of the e2e tests (prompts, expected hits)."""

from __future__ import annotations

import random

from sglang_simm_dev.tiny_model import PRESETS

#: the model every e2e server runs
TINY = PRESETS["llama-tiny"]
#: tokens per page of every e2e server
PAGE = 16
#: the device (L1) pool of every e2e server; the host pool holds twice that
DEVICE_TOKENS = 2048


def prompt(seed: int, length: int, vocab: int = TINY.vocab_size) -> list[int]:
    """Deterministic random token ids (above the special ids 0..2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def matchable_tokens(length: int, page_size: int) -> int:
    """The prefix a re-sent prompt can get from a cache: SGLang always
    computes the last token, and caches whole pages only."""
    return (length - 1) // page_size * page_size
