"""``HiCacheSiMM``: SGLang's L3 storage backend on SiMM, assembled from its parts.

* ``lifecycle``: attach (config, client, pools), re-registration, close, stats;
* ``v1``: the zero-copy page path (``batch_exists``, ``batch_get_v1``, ``batch_set_v1``);
* ``v2``: the hybrid models' side pools (``batch_*_v2``);
* ``copying``: SGLang's copying path (``batch_get``, ``batch_set``, ...);
* ``transfer``: what the paths share (a batch resolved to objects, answers read);
* ``inflight``: one call's pools counted in and out, and its faults.

Attach-time work may raise: a wrong setup must stop the server with a
message. Data-path methods never raise: SGLang's prefetch and backup
threads die on an exception, while a False is only a miss. Faults there
are counted by code and logged rate-limited.
"""

from __future__ import annotations

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from sglang_simm.copying import CopyingPath
from sglang_simm.lifecycle import CLOSE_WAIT_S, Lifecycle
from sglang_simm.transfer import Transfers
from sglang_simm.v1 import V1Path
from sglang_simm.v2 import V2Path

__all__ = ["CLOSE_WAIT_S", "HiCacheSiMM"]


class HiCacheSiMM(Lifecycle, V1Path, V2Path, CopyingPath, Transfers, HiCacheStorage):
    """SiMM as SGLang's HiCache L3 tier.

    Routes: ``simm`` (the plugin's registration: ``(storage_config,
    host_pool)``) and ``dynamic`` (``(storage_config, {})``; the pool comes
    through ``register_mem_pool_host``). ``client=`` injects a connected
    ``KVClient``; by default one is built from the configuration.
    """
