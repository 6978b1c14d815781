"""SiMM client return codes (``simm_rules``'s one table), which of them are
faults, and the exceptions this package raises.

Exception tree::

    SiMMError
     +-- ClientNotInstalledError   (the real ``simm.kv`` is missing or foreign)
     +-- ClusterUnreachableError   (warm-up round trip failed at attach)
     +-- UnsupportedPoolError      (a host pool or layout we refuse at attach)
     |    +-- PoolLeftOutError     (a side pool the attach goes on without)
     +-- BackendClosedError        (a pool registered with a closed backend)
"""

from __future__ import annotations

from sglang_simm.simm_rules import (  # noqa: F401 (re-exported)
    ADD_CHANNELS_FAILED,
    BUILD_CONNECTION_FAILED,
    CODE_NAMES,
    DELETE_OBJECT_FAILED,
    DEREGISTER_MR_FAILED,
    DS_CACHE_POOL_ALLOC_FAILED,
    DS_DATA_ALREADY_EXISTS,
    DS_KEY_NOT_FOUND,
    GET_OBJECT_FAILED,
    INTERNAL_ERROR,
    INVALID_ARGUMENT,
    LOOKUP_OBJECT_FAILED,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MEMPOOL_ALLOCATE_FAILED,
    MEMPOOL_INIT_FAILED,
    MEMPOOL_RELEASE_FAILED,
    OK,
    OUT_OF_MEMORY,
    PUT_OBJECT_FAILED,
    REGISTER_MR_FAILED,
    ROUTING_TABLE_FAILED,
    SEND_RPC_FAILED,
    SHARD_LOOKUP_FAILED,
    TARGET_NOT_FOUND,
    TARGET_UNAVAILABLE,
    TIMEOUT,
    UNKNOWN_ERROR,
    code_name,
)

#: The codes that say the store could not be reached or did not answer in
#: time: the transport, the routing (the manager's table, a shard's server),
#: a target that is down, a timeout, and the server failing inside
#: (``UnknownError`` is also the client's ``GetRoutingTableTimeout``). Asking
#: again soon is likely to cost the same wait, so the breaker counts these.
#:
#: Every other code is an answer from a working store (a miss, including
#: ``GetObjectFailed``, the synchronous get's answer for an absent key; a full
#: store; an object stored before) or a problem on this side that no backoff
#: cures (a refused argument, the client's memory pool and MR registration).
#: Unknown codes are no fault either: a breaker opened by a code we cannot
#: read would switch L3 off for every request, and a hang shows up as time.
FAULT_CODES: frozenset[int] = frozenset(
    {
        TIMEOUT,
        TARGET_NOT_FOUND,
        TARGET_UNAVAILABLE,
        INTERNAL_ERROR,
        UNKNOWN_ERROR,
        ROUTING_TABLE_FAILED,
        SHARD_LOOKUP_FAILED,
        SEND_RPC_FAILED,
        BUILD_CONNECTION_FAILED,
        ADD_CHANNELS_FAILED,
    }
)


def is_fault(code: int) -> bool:
    """True when ``code`` is in ``FAULT_CODES``: the one place faults are told
    from misses, for the real client and the local store alike."""
    return code in FAULT_CODES


class SiMMError(Exception):
    """Base class of every error this package raises on purpose."""


class ClientNotInstalledError(SiMMError, ImportError):
    """The real SiMM client (``simm.kv``) cannot be imported, or the module
    found is not SiMM's (PyPI's ``simm`` is an unrelated project)."""


class ClusterUnreachableError(SiMMError, ConnectionError):
    """The warm-up round trip at attach failed: the cluster cannot serve us."""


class UnsupportedPoolError(SiMMError, ValueError):
    """A host pool, layout or page geometry this backend refuses at attach."""


class PoolLeftOutError(UnsupportedPoolError):
    """A side pool this deployment cannot store whose absence SGLang's
    controller tolerates (its pages are left out of hits and transfers):
    the attach goes on without it, with a warning naming the cost."""


class BackendClosedError(SiMMError, RuntimeError):
    """A host pool was registered with a backend after its ``close()``."""
