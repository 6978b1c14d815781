"""Wire format between host-store clients and the store process.

Control messages only, one request per batch: keys, sizes and offsets,
never object bytes (clients copy those through the shared arena). A frame
is a header ``<u32 body length><u8 op>`` and a body. Requests and replies
alternate on a connection in order, except ``RELEASE``, ``ABORT`` and
``FENCE``, which get no reply: each says the client is done with memory,
and nothing it does next depends on when the store reads it.

Bodies are made of:
* key lists: ``<u32 n><u32 bytes><keys joined by NUL>``, UTF-8 with
  surrogates passed (the real client takes any ``str``). The real client
  sends a key's ``c_str()``, so a key ends at its first NUL there; it does
  here too, which is what makes NUL a safe separator;
* int lists: ``<u32 n><i64 x n>``;
* JSON objects, for the handshake and the operator commands.

Pure functions, no I/O.
"""

from __future__ import annotations

import json
import struct
from array import array
from enum import IntEnum
from typing import Any, Sequence

#: Bumped on any change a client and a store process must agree on.
PROTOCOL_VERSION = 4

HEADER = struct.Struct("<IB")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


class Op(IntEnum):
    HELLO = 1  # JSON -> JSON
    LOOKUP = 2  # keys -> codes
    PUT = 3  # u8 overwrite, keys, sizes -> lease, codes, offsets, committed end
    COMMIT = 4  # lease -> codes (one per reserved entry, entry order)
    ABORT = 5  # lease -> (no reply)
    GET = 6  # keys, capacities -> [lease, lease slot], sizes or codes, offsets
    RELEASE = 7  # lease -> (no reply)
    DELETE = 8  # keys (one) -> codes
    DELETE_PREFIX = 9  # keys (one prefix) -> ints [count]
    ADMIN = 10  # JSON -> JSON (stats, clear, keys, set_capacity, stop)
    FENCE = 13  # i64 epoch, i64 connection -> (no reply): this process is done with that connection's leases
    ERROR = 255  # reply: JSON {"error": text, "code": SiMM code}


#: Ops whose request gets no reply.
ONE_WAY = frozenset({Op.ABORT, Op.RELEASE, Op.FENCE})


class ProtocolError(Exception):
    """A malformed frame: the connection is dropped."""


def frame(op: Op, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return HEADER.pack(len(body), op) + body


def encode_keys(keys: Sequence[str]) -> bytes:
    """The key-list part of a body (one join and one encode for a batch)."""
    joined = "\0".join(keys)
    if joined.count("\0") > max(len(keys) - 1, 0):  # a key holds a NUL
        joined = "\0".join(k.split("\0", 1)[0] for k in keys)
    blob = joined.encode("utf-8", "surrogatepass")
    return _U32.pack(len(keys)) + _U32.pack(len(blob)) + blob


def pack_keys(raw: Sequence[bytes]) -> bytes:
    """The key-list part from keys already in bytes (without NULs)."""
    blob = b"\0".join(raw)
    return _U32.pack(len(raw)) + _U32.pack(len(blob)) + blob


def pack_i64(value: int) -> bytes:
    return _I64.pack(value)


def pack_ints(values: Sequence[int]) -> bytes:
    return _U32.pack(len(values)) + array("q", values).tobytes()


def pack_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


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
        part = self._buf[self._pos : end]
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
