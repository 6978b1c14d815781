"""The one place the KV event tests make the local store refuse puts.

Today the local store takes its fault flags from the client
(``local_store_error_rate``: that share of the entries of every call fails
with SendRPCFailed), set in this process (``configure_faults``) or, for a
server, through the extra config's ``client_flags``. When fault injection
moves to a test instrument, only this module changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["refused_puts", "refusing_server"]


@contextmanager
def refused_puts(store_name: str) -> Iterator[None]:
    """While inside, every entry of every call of this process to the
    store ``store_name`` fails (puts included)."""
    from sglang_simm.embedded import configure_faults

    configure_faults(store_name, error_rate=1.0)
    try:
        yield
    finally:
        configure_faults(store_name, error_rate=0.0)


def refusing_server(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """A server's extra config whose store client fails every entry of
    every call (puts included). No warm-up round trip: it would fail and
    stop the start; no breaker: every backup must reach the store and be
    refused there, not be skipped while the breaker is open."""
    flags = dict(extra_config.get("client_flags") or {})
    flags["local_store_error_rate"] = "1"
    return {**extra_config, "client_flags": flags, "warmup": False, "breaker_enabled": False}
