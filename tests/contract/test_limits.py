"""Key and value limits, checked by the client before the network.

Keys: at most MAX_KEY_BYTES (256) bytes of UTF-8. Values: at most
MAX_VALUE_BYTES (64 MiB - 20 KiB). One bad entry fails a whole batch with
INVALID_ARGUMENT, and nothing of that batch is written or read.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from sglang_simm.errors import (
    GET_OBJECT_FAILED,
    INVALID_ARGUMENT,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    OK,
)


def run(coro):
    return asyncio.run(coro)


def sized_key(prefix: str, char: str, total_bytes: int) -> str:
    """``prefix`` padded with ``char`` to exactly ``total_bytes`` UTF-8 bytes
    (ASCII filler makes up any remainder)."""
    width = len(char.encode())
    room = total_bytes - len(prefix.encode())
    k = prefix + char * (room // width) + "x" * (room % width)
    assert len(k.encode()) == total_bytes
    return k


KEY_CASES = [
    # (filler, UTF-8 bytes, valid)
    ("a", 256, True),
    ("a", 257, False),
    ("é", 256, True),  # 2-byte characters: 128-ish characters, 256 bytes
    ("é", 258, False),
    ("€", 255, True),  # 3-byte characters
    ("€", 258, False),  # ~86 characters but 258 bytes: counted in bytes
    ("😀", 256, True),  # 4-byte characters
    ("😀", 260, False),
]
KEY_IDS = [f"{'ascii' if c == 'a' else f'{len(c.encode())}byte'}-{n}B" for c, n, _ in KEY_CASES]


@pytest.mark.parametrize(("filler", "total", "valid"), KEY_CASES, ids=KEY_IDS)
def test_key_length_limit_in_utf8_bytes(store, mem, key, filler, total, valid):
    k = sized_key(key("lim-"), filler, total)
    assert len(k) <= MAX_KEY_BYTES or not valid  # a char count would get these wrong
    src, _ = mem.holding(torch.arange(64, dtype=torch.uint8))
    dst, _ = mem.view(64)
    if valid:
        assert store.put(k, src) == OK
        assert store.exists(k) is True
        assert store.get(k, dst) == 64
        assert store.mexists([k]) == [True]
        assert store.delete(k) == OK
    else:
        assert store.put(k, src) == INVALID_ARGUMENT
        assert store.get(k, dst) == INVALID_ARGUMENT
        assert store.delete(k) == INVALID_ARGUMENT
        assert store.exists(k) is False
        assert store.mput([k], [src]) == [INVALID_ARGUMENT]
        assert store.mget([k], [dst]) == [INVALID_ARGUMENT]
        assert store.mexists([k]) == [False]
        assert run(store.put_async(k, src)) == INVALID_ARGUMENT
        assert run(store.get_async(k, dst)) == INVALID_ARGUMENT
        assert run(store.delete_async(k)) == INVALID_ARGUMENT
        assert run(store.exists_async(k)) is False


def test_empty_key_is_an_ordinary_key(store, mem):
    """Neither SiMM's client nor its data server checks for an empty key."""
    src, _ = mem.holding(torch.arange(8, dtype=torch.uint8))
    dst, out = mem.view(8, fill=0)
    assert store.put("", src) == OK
    assert store.exists("") is True and store.mexists(["", "x" * 10]) == [True, False]
    assert store.get("", dst) == 8 and torch.equal(out, torch.arange(8, dtype=torch.uint8))
    assert store.delete("") == OK


def test_value_of_exactly_max_size_roundtrips(store, key):
    block = store.allocate(MAX_VALUE_BYTES)
    ref = block.as_ref()
    ref.fill_(0x5C)
    ref[:4096] = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    ref[-4096:] = 0xC5
    k = key()
    assert store.put(k, block.view()) == OK
    del block, ref

    out = store.allocate(MAX_VALUE_BYTES)
    got = out.as_ref()
    got.zero_()
    assert store.get(k, out.view()) == MAX_VALUE_BYTES
    assert torch.equal(got[:4096], torch.arange(4096, dtype=torch.int32).to(torch.uint8))
    assert bool((got[4096:-4096] == 0x5C).all())
    assert bool((got[-4096:] == 0xC5).all())
    assert store.delete(k) == OK


def test_value_over_max_size_is_invalid(store, key):
    block = store.allocate(MAX_VALUE_BYTES + 1)  # allocating it is allowed (the client only warns)
    k = key()
    assert store.put(k, block.view()) == INVALID_ARGUMENT
    assert run(store.put_async(k, block.view())) == INVALID_ARGUMENT
    assert store.mput([k], [block.view()]) == [INVALID_ARGUMENT]
    assert store.exists(k) is False


def test_empty_value_is_stored(kv, store, mem, key, local_store_only):
    # Nothing in SiMM refuses it; whether the real 0-byte RDMA read succeeds
    # is up to SiCL (closed source), so this is pinned down here only.
    _, chunk = mem.view(8)
    view = kv.BlockView.from_buffer(chunk.data_ptr(), 0, mem.mr)
    k = key()
    assert store.put(k, view) == OK
    assert store.exists(k) is True
    assert store.get(k, mem.view(8)[0]) == 0


def test_one_bad_key_fails_the_whole_mput(store, mem, key, rand):
    keys = [key("a"), key("b") + "x" * MAX_KEY_BYTES, key("c")]
    views = [mem.holding(rand(100, seed=i))[0] for i in range(3)]
    assert store.mput(keys, views) == [INVALID_ARGUMENT] * 3
    assert store.mexists([keys[0], keys[2]]) == [False, False]


def test_one_oversized_value_fails_the_whole_mput(store, mem, key, rand):
    big = store.allocate(MAX_VALUE_BYTES + 1)
    keys = [key("a"), key("b"), key("c")]
    views = [mem.holding(rand(100))[0], big.view(), mem.holding(rand(100))[0]]
    assert store.mput(keys, views) == [INVALID_ARGUMENT] * 3
    assert store.mexists(keys) == [False, False, False]


def test_one_bad_key_fails_the_whole_mget_and_mexists(store, mem, key, rand):
    good = key("good")
    assert store.put(good, mem.holding(rand(100))[0]) == OK
    bad = key("bad") + "x" * MAX_KEY_BYTES
    dst, out = mem.view(100, fill=0)
    assert store.mget([good, bad], [dst, mem.view(100)[0]]) == [INVALID_ARGUMENT] * 2
    assert bool((out == 0).all()), "a failed batch still read data"
    assert store.mexists([good, bad]) == [False, False]


@pytest.mark.parametrize(
    ("n_keys", "n_views"), [(3, 2), (1, 3), (0, 1)], ids=["3keys-2views", "1key-3views", "0keys-1view"]
)
def test_batch_length_mismatch_fails_every_key(store, mem, key, n_keys, n_views):
    keys = [key(str(i)) for i in range(n_keys)]
    views = [mem.view(32, fill=1)[0] for _ in range(n_views)]
    assert store.mput(keys, views) == [INVALID_ARGUMENT] * n_keys
    assert store.mget(keys, views) == [INVALID_ARGUMENT] * n_keys
    if keys:
        assert store.mexists(keys) == [False] * n_keys


@pytest.mark.parametrize("bad_key", [b"bytes-key", 42, None], ids=["bytes", "int", "None"])
def test_non_str_key_raises_type_error(store, mem, bad_key):
    view, _ = mem.view(8)
    for call in (
        lambda: store.put(bad_key, view),
        lambda: store.get(bad_key, view),
        lambda: store.exists(bad_key),
        lambda: store.delete(bad_key),
        lambda: store.mput([bad_key], [view]),
        lambda: store.mget([bad_key], [view]),
        lambda: store.mexists([bad_key]),
    ):
        with pytest.raises(TypeError):
            call()


def test_non_view_raises_attribute_error(store, key):
    """SiMM's wrapper reads ``block._data`` in Python before the native call."""
    tensor = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(AttributeError):
        store.put(key(), tensor)
    with pytest.raises(AttributeError):
        store.get(key(), tensor)
    with pytest.raises(AttributeError):
        store.mput([key()], [tensor])
    with pytest.raises(AttributeError):
        run(store.get_async(key(), tensor))


def test_key_that_is_not_utf8_raises_type_error(store, mem):
    view, _ = mem.view(8)
    for call in (lambda: store.put("bad-\udcff", view), lambda: store.mexists(["bad-\udcff"])):
        with pytest.raises(TypeError):
            call()


def test_missing_key_is_not_a_limit_error(store, mem, key):
    k = sized_key(key("lim-"), "a", MAX_KEY_BYTES)
    assert store.get(k, mem.view(8)[0]) == GET_OBJECT_FAILED
