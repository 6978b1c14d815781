"""The local store's wire format."""

from __future__ import annotations

import pytest

from sglang_simm.local_store._protocol import (
    HEADER,
    Op,
    ProtocolError,
    Reader,
    encode_keys,
    frame,
    pack_i64,
    pack_ints,
    pack_json,
    whole_frame,
)


@pytest.mark.parametrize(
    "keys",
    [[], [""], ["a"], ["", "", ""], ["s1.abc/" + "f" * 64 + ".k", "ünïcödé", "\udcff-surrogate"], ["x"] * 300],
)
def test_keys_round_trip(keys):
    assert Reader(encode_keys(keys)).keys() == [k.encode("utf-8", "surrogatepass") for k in keys]


def test_a_key_ends_at_its_first_nul_as_on_the_real_client():
    assert Reader(encode_keys(["ab\0cd", "e", "\0"])).keys() == [b"ab", b"e", b""]


def test_a_body_of_several_parts_reads_back_in_order():
    body = bytes((1,)) + encode_keys(["a", "b"]) + pack_ints([5, -6]) + pack_i64(7)
    r = Reader(frame(Op.PUT, body)[HEADER.size:])
    assert (r.u8(), r.keys(), r.ints(), r.i64()) == (1, [b"a", b"b"], [5, -6], 7)
    r.done()


def test_frame_header_holds_length_and_op():
    data = frame(Op.LOOKUP, b"xyz")
    assert HEADER.unpack_from(data) == (3, Op.LOOKUP) and data[HEADER.size:] == b"xyz"


def test_a_frame_is_whole_only_once_every_byte_of_its_body_is_in():
    data = frame(Op.GET, pack_ints([1, 2, 3]))
    assert all(not whole_frame(data[:n]) for n in range(len(data)))
    assert whole_frame(data) and whole_frame(data + b"the next frame's first bytes")


def test_ints_are_signed_64_bit():
    values = [0, -1, 1, -(2**63), 2**63 - 1]
    assert Reader(pack_ints(values)).ints() == values
    assert Reader(pack_i64(-(2**63))).i64() == -(2**63)


def test_json_part():
    assert Reader(pack_json({"cmd": "status", "n": [1]})).json() == {"cmd": "status", "n": [1]}


@pytest.mark.parametrize(
    ("body", "part"),
    [
        (b"\x01\x00", "ints"),  # cut inside a count
        (pack_ints([1, 2])[:-1], "ints"),  # cut inside the values
        (b"\x02\x00\x00\x00\x01\x00\x00\x00a", "keys"),  # two keys announced, one given
        (b"\x00\x00\x00\x00\x01\x00\x00\x00a", "keys"),  # no keys announced, bytes given
        (b"\x01\x00\x00\x00\x09\x00\x00\x00a", "keys"),  # more key bytes announced than given
    ],
)
def test_malformed_bodies_are_protocol_errors(body, part):
    with pytest.raises(ProtocolError):
        getattr(Reader(body), part)()


def test_left_over_bytes_are_a_protocol_error():
    r = Reader(pack_ints([1]) + b"!")
    r.ints()
    with pytest.raises(ProtocolError):
        r.done()
