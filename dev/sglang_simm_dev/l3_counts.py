"""Pages a server's backend stored in L3 and read back, from its local store's
own counters (``sglang-simm store status NAME`` shows the same ones).

The store process counts objects: ``puts`` (objects published), ``hits``
(get entries that found their object) and ``deletes`` (objects deleted one
by one). Every attach's start-up round trip puts, reads and deletes one
object of its own, and the backend deletes nothing else one by one (its
``clear`` deletes by prefix), so ``deletes`` counts the warm-ups. A page is
``objects_per_page`` objects, so::

    pages stored = (puts - deletes) // objects_per_page
    pages read   = (hits - deletes) // objects_per_page

A write puts every page of the batch, already stored or not (SiMM's ``mput``
overwrites), so a page written twice counts twice, as the backend's own
``pages_written`` does. Counters only grow; callers compare two readings.
Each TP rank stores its own objects (MLA ranks share theirs), so a TP = 2
MHA server counts each page once per rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Objects of one page: K and V (MHA), or the one latent buffer (MLA).
MHA_OBJECTS_PER_PAGE = 2
MLA_OBJECTS_PER_PAGE = 1


@dataclass(frozen=True)
class L3Objects:
    """One reading of a local store's counters (objects, since it started)."""

    puts: int
    hits: int
    warmups: int  # objects deleted one by one: the attaches' round trips

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> L3Objects:
        return cls(*(int(status[name]) for name in ("puts", "hits", "deletes")))

    @property
    def stored(self) -> int:
        """Page objects published (the warm-ups left out)."""
        return self.puts - self.warmups

    @property
    def read(self) -> int:
        """Page objects read back (the warm-ups left out)."""
        return self.hits - self.warmups


def pages(objects: int, objects_per_page: int) -> int:
    """Whole pages in ``objects`` (a page half stored is no page)."""
    if objects_per_page < 1:
        raise ValueError(f"objects_per_page must be >= 1, got {objects_per_page}")
    return objects // objects_per_page


def objects_per_page(model_path: str) -> int:
    """Objects per page for the model at ``model_path``: 1 for an MLA model
    (its ``config.json`` has ``kv_lora_rank``, as DeepSeek's do), else 2.
    A page object over SiMM's value limit (64 MiB) is cut into chunks,
    which this does not expect: no test or demo model comes near it."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot tell the objects per page of {model_path!r} from its config.json ({exc}); "
            "set ServerConfig.l3_objects_per_page"
        ) from exc
    return MLA_OBJECTS_PER_PAGE if config.get("kv_lora_rank") else MHA_OBJECTS_PER_PAGE


def host_store_name(extra_config: Mapping[str, Any]) -> str | None:
    """The local store a backend with this extra config uses (``local`` or
    ``local://NAME``), or None (a cluster, an in-process local store, or no
    ``manager_address`` here): only a local store's counters can be read
    from another process."""
    address = extra_config.get("manager_address")
    if not isinstance(address, str):
        return None
    from sglang_simm.config import SiMMConfig

    config = SiMMConfig(manager_address=address)
    return config.local_store_name if config.local_store_scope == "host" else None


class StoreCounter:
    """Reads one local store's counters from this process; ``close()`` (or
    ``with``) drops its connection. Reconnects on the next reading after
    the store went away, and raises ``StoreUnreachable`` while it is gone."""

    def __init__(self, name: str, *, root: str | None = None, objects_per_page: int = MHA_OBJECTS_PER_PAGE,
                 timeout_s: float = 10.0) -> None:
        pages(0, objects_per_page)  # a bad value fails here
        self.name = name
        self.root = root
        self.objects_per_page = objects_per_page
        self.timeout_s = timeout_s
        self._handle: Any = None

    def status(self) -> dict[str, Any]:
        """The store's whole status (``sglang-simm store status NAME --json``:
        the counters, ``used_bytes``, ``capacity_bytes``, ``evictions``, ...)."""
        from sglang_simm.local_store.admin import StoreHandle

        if self._handle is None:
            handle = StoreHandle(self.name, root=self.root, capacity=1, spawn=False, timeout_s=self.timeout_s,
                                 data=False)
            handle.open(wait_s=self.timeout_s)
            self._handle = handle
        try:
            return self._handle.status()
        except BaseException:
            self.close()
            raise

    def objects(self) -> L3Objects:
        return L3Objects.from_status(self.status())

    def pages_stored(self) -> int:
        return pages(self.objects().stored, self.objects_per_page)

    def pages_read(self) -> int:
        return pages(self.objects().read, self.objects_per_page)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()

    def __enter__(self) -> StoreCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
