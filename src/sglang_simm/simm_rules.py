"""SiMM's rules, as its client applies them: the return codes and their
names, the key and value limits, and what makes a key.

The backend, the operator's tools and the local store all read them here:
the local store returns exactly these codes and enforces exactly these
limits, so code written against ``simm.kv`` sees the same answers on
either. Standard library only; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The real client's return codes (int16; 0 is success, every error negative).
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

#: Codes of a request that never got the data server's answer (lost, timed
#: out, not sent): the real client passes them through on every path, while
#: it maps the data server's own refusals per path.
TRANSPORT_CODES = frozenset({TIMEOUT, SEND_RPC_FAILED, BUILD_CONNECTION_FAILED, ADD_CHANNELS_FAILED})

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


#: The real client's limits (see the SiMM client contract).
MAX_KEY_BYTES = 256
MAX_VALUE_BYTES = 64 * 1024 * 1024 - 20 * 1024  # 67,088,384


def code_name(code: int) -> str:
    """``-1002`` -> ``"Timeout(-1002)"``; unknown codes keep their number."""
    return f"{CODE_NAMES.get(int(code), 'Code')}({int(code)})"


def key_fits(key: object, budget: int = MAX_KEY_BYTES, *, empty_ok: bool = False) -> bool:
    """The one rule for a usable key: a ``str`` of at most ``budget`` bytes in
    UTF-8 (SiMM counts key bytes; text with no UTF-8 form is no key).
    ``budget`` is SiMM's limit, or a caller's smaller one. SiMM itself takes
    an empty key (``empty_ok``); a caller whose keys name something may
    refuse it. Only non-ASCII text needs encoding: ``len`` never counts more
    than the bytes.
    """
    if not isinstance(key, str) or (not key and not empty_ok) or len(key) > budget:
        return False
    if key.isascii():
        return True
    try:
        return len(key.encode("utf-8")) <= budget
    except UnicodeEncodeError:
        return False


def keys_fit(keys: Sequence[object], budget: int = MAX_KEY_BYTES, *, empty_ok: bool = False) -> bool:
    """``key_fits`` for every key of a batch."""
    return all(key_fits(k, budget, empty_ok=empty_ok) for k in keys)
