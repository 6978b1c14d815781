"""The local store's names as users meet them, and the old ones still read.

The store behind ``manager_address: "local"`` (and ``"inprocess"``) is the
*local store* everywhere: its config field and client flags are
``local_store_*``. Until the next minor release the old ``embedded_*``
spellings are read too, each with a warning naming the new one; giving
an old and a new spelling of one setting together is refused.

Standard library only: ``sglang_simm.config`` and the store process import
it.
"""

from __future__ import annotations

__all__ = ["RENAMED_FLAGS", "both_given", "deprecated"]

#: The local store's client flags, old name -> new name.
RENAMED_FLAGS: dict[str, str] = {
    "embedded_scope": "local_store_scope",
    "embedded_store_dir": "local_store_dir",
    "embedded_capacity_bytes": "local_store_capacity_bytes",
    "embedded_eviction": "local_store_eviction",
    "embedded_idle_exit_s": "local_store_idle_exit_s",
    "embedded_simm_release": "local_store_simm_release",
    "embedded_get_bound": "local_store_get_bound",
    "embedded_error_rate": "local_store_error_rate",
    "embedded_error_code": "local_store_error_code",
    "embedded_latency_us": "local_store_latency_us",
    "embedded_down": "local_store_down",
    "embedded_corrupt_reads": "local_store_corrupt_reads",
    "embedded_seed": "local_store_seed",
}


def deprecated(old: str, new: str) -> str:
    """The one wording of an old name that is still read."""
    return f"{old} is deprecated: use {new} (the old name is read until the next minor release)"


def both_given(old: str, new: str) -> str:
    """The one wording of an old and a new name given together."""
    return f"both {old} (deprecated) and {new} are given: give only {new}"
