"""SiMM client return codes, and the exceptions this package raises.

The codes and their names are the real SiMM client's (int16, negative); the
local store returns exactly these, and the backend counts faults by them,
so both sides must agree on one table.

Exception tree::

    SiMMError
     +-- ClientNotInstalledError   (the real ``simm.kv`` is missing or foreign)
     +-- ClusterUnreachableError   (warm-up round trip failed at attach)
     +-- UnsupportedPoolError      (a host pool or layout we refuse at attach)
     |    +-- PoolLeftOutError     (a side pool the attach goes on without)
     +-- BackendClosedError        (a pool registered with a closed backend)
"""

from __future__ import annotations

OK = 0
INVALID_ARGUMENT = -1000
TIMEOUT = -1002
OUT_OF_MEMORY = -1003
TARGET_NOT_FOUND = -1900
TARGET_UNAVAILABLE = -1901
INTERNAL_ERROR = -1999
UNKNOWN_ERROR = -2000
ROUTING_TABLE_FAILED = -2001
SHARD_LOOKUP_FAILED = -2002
PUT_OBJECT_FAILED = -2100
GET_OBJECT_FAILED = -2101
DELETE_OBJECT_FAILED = -2102
LOOKUP_OBJECT_FAILED = -2103
MEMPOOL_INIT_FAILED = -2200
MEMPOOL_ALLOCATE_FAILED = -2201
MEMPOOL_RELEASE_FAILED = -2202
REGISTER_MR_FAILED = -2203
DEREGISTER_MR_FAILED = -2204
SEND_RPC_FAILED = -2300
BUILD_CONNECTION_FAILED = -2301
ADD_CHANNELS_FAILED = -2302
DS_KEY_NOT_FOUND = -4003
DS_DATA_ALREADY_EXISTS = -4005
DS_CACHE_POOL_ALLOC_FAILED = -4006

#: The client's name of every code above, for counters and logs.
CODE_NAMES: dict[int, str] = {
    OK: "OK",
    INVALID_ARGUMENT: "InvalidArgument",
    TIMEOUT: "Timeout",
    OUT_OF_MEMORY: "OutOfMemory",
    TARGET_NOT_FOUND: "TargetNotFound",
    TARGET_UNAVAILABLE: "TargetUnavailable",
    INTERNAL_ERROR: "InternalError",
    UNKNOWN_ERROR: "UnknownError",
    ROUTING_TABLE_FAILED: "RoutingTableFailed",
    SHARD_LOOKUP_FAILED: "ShardLookupFailed",
    PUT_OBJECT_FAILED: "PutObjectFailed",
    GET_OBJECT_FAILED: "GetObjectFailed",
    DELETE_OBJECT_FAILED: "DeleteObjectFailed",
    LOOKUP_OBJECT_FAILED: "LookupObjectFailed",
    MEMPOOL_INIT_FAILED: "MempoolInitFailed",
    MEMPOOL_ALLOCATE_FAILED: "MempoolAllocateFailed",
    MEMPOOL_RELEASE_FAILED: "MempoolReleaseFailed",
    REGISTER_MR_FAILED: "RegisterMRFailed",
    DEREGISTER_MR_FAILED: "DeregisterMRFailed",
    SEND_RPC_FAILED: "SendRPCFailed",
    BUILD_CONNECTION_FAILED: "BuildConnectionFailed",
    ADD_CHANNELS_FAILED: "AddChannelsFailed",
    DS_KEY_NOT_FOUND: "DataServerKeyNotFound",
    DS_DATA_ALREADY_EXISTS: "DataServerDataAlreadyExists",
    DS_CACHE_POOL_ALLOC_FAILED: "DataServerCachePoolAllocFailed",
}

#: The codes that say the store could not be reached or did not answer in
#: time: the transport (send, connect, channels), the routing (the cluster
#: manager's table, a shard's server), a target that is down, a timeout, and
#: the server failing inside (``InternalError``; ``UnknownError`` is also the
#: client's ``GetRoutingTableTimeout``). Asking again soon is likely to cost
#: the same wait, so the breaker (``sglang_simm.breaker``) counts these.
#:
#: Every other code is an answer from a working store, or a problem on this
#: side that no backoff cures, so never a fault: a miss (``DataServerKeyNotFound``;
#: ``GetObjectFailed``, the synchronous get's only answer for an absent key),
#: a full store (``OutOfMemory``, ``DataServerCachePoolAllocFailed``,
#: ``PutObjectFailed``), an object stored before, a refused argument, or the
#: client's own memory pool and MR registration (local resources). So are
#: codes missing from ``CODE_NAMES`` and byte counts (>= 0): a breaker opened
#: by a code we cannot read would switch L3 off for every request, and a hang
#: shows up as time anyway (the breaker counts a call that took the client's
#: whole request time limit as a timeout).
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
    """True when ``code`` says the store could not be reached or did not
    answer in time (``FAULT_CODES``); False for a miss, any other answer of
    a working store, a local problem, a byte count or an unknown code.

    The one place faults are told from misses, for the real client and the
    local store alike (it returns the real client's codes)."""
    return code in FAULT_CODES


#: The real client's limits (see the SiMM client contract).
MAX_KEY_BYTES = 256
MAX_VALUE_BYTES = 64 * 1024 * 1024 - 20 * 1024  # 67,088,384


def code_name(code: int) -> str:
    """``-1002`` -> ``"Timeout(-1002)"``; unknown codes keep their number."""
    return f"{CODE_NAMES.get(int(code), 'Code')}({int(code)})"


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
