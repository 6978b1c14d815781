"""The one place the KV event tests make the local store refuse puts: the
test instrument's faulty network (``sglang_simm_dev.faults``) fails every
entry of every call with SendRPCFailed, in this process or in a server."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sglang_simm_dev.faults import ENV, configure_faults

__all__ = ["refused_puts", "refusing_server"]


@contextmanager
def refused_puts(store_name: str) -> Iterator[None]:
    """While inside, every entry of every call of this process to the
    store ``store_name`` fails (puts included)."""
    configure_faults(store_name, error_rate=1.0)
    try:
        yield
    finally:
        configure_faults(store_name, error_rate=0.0)


def refusing_server(extra_config: Mapping[str, Any], store_name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A server's extra config and environment whose store client fails
    every entry of every call (puts included). No warm-up round trip: it
    would fail and stop the start; no breaker: every backup must reach the
    store and be refused there, not be skipped while the breaker is open."""
    return ({**extra_config, "warmup": False, "breaker_enabled": False},
            {ENV: json.dumps({store_name: {"error_rate": 1}})})
