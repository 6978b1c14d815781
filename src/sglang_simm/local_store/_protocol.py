"""The wire format between clients and the store process.

Control messages only, one request per batch: keys, sizes and offsets,
never object bytes (clients copy those through the segments). A frame is
``<u32 body length><u8 op>`` and a body made of parts:

* key lists: ``<u32 n><u32 bytes><keys joined by NUL>`` (UTF-8, surrogates
  passed). The real client sends a key's ``c_str()``, so a key ends at its
  first NUL there; it does here too, which makes NUL a safe separator;
* int lists: ``<u32 n><i64 x n>``;
* JSON objects (the handshake, the operator's commands).

Requests and replies alternate on a connection, except ``ABORT`` and
``RELEASE``, which get no reply: each says the client is done with memory,
and nothing it does next depends on when the store reads it. The HELLO
reply carries the segments' descriptors (``SCM_RIGHTS``). Pure functions.
"""

from __future__ import annotations

import json
import struct
from array import array
from enum import IntEnum
from typing import Any, Sequence

#: Bumped on any change a client and a store process must agree on.
PROTOCOL_VERSION = 6

HEADER = struct.Struct("<IB")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


class Op(IntEnum):
    HELLO = 1  # JSON -> JSON, with the segments' descriptors
    LOOKUP = 2  # keys -> codes
    PUT = 3  # u8 overwrite, keys, sizes -> [grant, committed end], codes, offsets
    COMMIT = 4  # i64 grant, checksums -> codes (one per granted entry, in entry order)
    ABORT = 5  # i64 grant -> (no reply)
    GET = 6  # keys, capacities -> [grant], sizes or codes, segments, offsets, checksums to verify
    RELEASE = 7  # i64 grant, entries whose checksum failed -> (no reply)
    DELETE = 8  # keys (one) -> codes
    DELETE_PREFIX = 9  # keys (one prefix) -> [count]
    ADMIN = 10  # JSON -> JSON
    REMOVED = 11  # i64 cursor -> [end, lost], keys removed, prefixes cleared
    ERROR = 255  # reply: JSON {"error": text, "code": SiMM code}


ONE_WAY = frozenset({Op.ABORT, Op.RELEASE})


class ProtocolError(Exception):
    """A malformed frame: the connection is dropped."""


def frame(op: Op, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return HEADER.pack(len(body), op) + body


def encode_keys(keys: Sequence[str]) -> bytes:
    joined = "\0".join(keys)
    if joined.count("\0") > max(len(keys) - 1, 0):  # a key holds a NUL: it ends there
        joined = "\0".join(k.split("\0", 1)[0] for k in keys)
    return pack_keys(len(keys), joined.encode("utf-8", "surrogatepass"))


def pack_keys(n: int, blob: bytes) -> bytes:
    """A key list of ``n`` keys joined by NUL into ``blob``."""
    return _U32.pack(n) + _U32.pack(len(blob)) + blob


def pack_i64(value: int) -> bytes:
    return _I64.pack(value)


def pack_ints(values: Sequence[int]) -> bytes:
    return _U32.pack(len(values)) + array("q", values).tobytes()


def pack_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def whole_frame(buf: bytes | bytearray) -> bool:
    """Whether ``buf`` starts with a whole frame."""
    return len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(buf)[0]


class Reader:
    """Reads the parts of one body in order."""

    __slots__ = ("_buf", "_pos")

    def __init__(self, body: bytes | memoryview) -> None:
        self._buf = memoryview(body)
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise ProtocolError(f"frame ends {end - len(self._buf)} bytes early")
        part = self._buf[self._pos:end]
        self._pos = end
        return part

    def u8(self) -> int:
        return self._take(1)[0]

    def i64(self) -> int:
        return _I64.unpack(self._take(8))[0]

    def _count(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def keys(self) -> list[bytes]:
        n = self._count()
        blob = bytes(self._take(self._count()))
        if n == 0:
            if blob:
                raise ProtocolError("an empty key list with key bytes")
            return []
        out = blob.split(b"\0")
        if len(out) != n:
            raise ProtocolError(f"a key list announced {n} keys and holds {len(out)}")
        return out

    def ints(self) -> list[int]:
        n = self._count()
        values = array("q")
        values.frombytes(self._take(8 * n))
        return values.tolist()

    def json(self) -> Any:
        return json.loads(bytes(self._take(len(self._buf) - self._pos)))

    def done(self) -> None:
        if self._pos != len(self._buf):
            raise ProtocolError(f"{len(self._buf) - self._pos} bytes left over in a frame")
