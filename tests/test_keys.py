"""The key module: pure functions, so every rule is checked directly."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_simm import keys
from sglang_simm.errors import MAX_KEY_BYTES

HASH = "a3" * 32  # SGLang page hashes are 64 hex digits

BASE = keys.PageIdentity(
    model_name="meta-llama/Llama-3.1-8B-Instruct",
    is_mla=False,
    tp_size=2,
    tp_rank=1,
    pp_size=1,
    pp_rank=0,
    page_size=64,
    dtype="torch.bfloat16",
    layout="page_first",
    object_bytes=(4 * 1024 * 1024, 4 * 1024 * 1024),
)


def keys_of(identity: keys.PageIdentity, page: str = HASH) -> list[str]:
    prefix = keys.namespaced_prefix(identity)
    return keys.object_keys(prefix, [page], keys.namespaced_suffixes(identity))


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "Qwen/Qwen3-8B"},
        {"tp_size": 4},
        {"tp_rank": 0},
        {"page_size": 32},
        {"dtype": "torch.float16"},
        {"layout": "page_first_direct"},
        {"object_bytes": (2 * 1024 * 1024, 2 * 1024 * 1024)},
        {"extra_backend_tag": "tenant-a"},
        {"pp_size": 2, "pp_rank": 1},
        {"attn_cp_size": 2, "attn_cp_rank": 1},
        {"pool": "mamba"},
    ],
    ids=lambda c: ",".join(c),
)
def test_any_meaningful_difference_changes_every_key(change):
    other = dataclasses.replace(BASE, **change)
    assert set(keys_of(BASE)).isdisjoint(keys_of(other))


def test_same_identity_same_keys_and_hash_is_kept_verbatim():
    again = dataclasses.replace(BASE)
    assert keys_of(BASE) == keys_of(again)
    assert all(HASH in k for k in keys_of(BASE))
    assert [k[-2:] for k in keys_of(BASE)] == [".k", ".v"]


def test_mla_pages_are_shared_by_every_tp_rank_and_size():
    mla = dataclasses.replace(BASE, is_mla=True, object_bytes=(1 << 20,))
    ranks = {tuple(keys_of(dataclasses.replace(mla, tp_rank=r, tp_size=s))) for s in (1, 8) for r in range(s)}
    assert len(ranks) == 1
    (only,) = ranks
    assert len(only) == 1 and only[0].endswith(".kv")


def test_split_heads_name_head_groups_so_different_tp_sizes_share_them():
    # tp_lcm_size 4: a TP-2 rank holds groups {2r, 2r+1}; a TP-4 rank holds {r}.
    tp2 = dataclasses.replace(BASE, layout="page_head", tp_size=2, tp_rank=1, tp_lcm_size=4,
                              object_bytes=(1 << 20,) * 4)
    tp4 = dataclasses.replace(BASE, layout="page_head", tp_size=4, tp_rank=3, tp_lcm_size=4,
                              object_bytes=(1 << 20,) * 2)
    assert tp2.split_factor == 2 and tp4.split_factor == 1
    assert keys.namespaced_suffixes(tp2) == (".h2of4.k", ".h2of4.v", ".h3of4.k", ".h3of4.v")
    # Same per-object bytes is what makes the objects interchangeable.
    tp4_as_split = dataclasses.replace(tp4, tp_lcm_size=8, tp_size=4, object_bytes=(1 << 20,) * 4)
    tp2_8 = dataclasses.replace(tp2, tp_lcm_size=8, tp_size=2, tp_rank=0, object_bytes=(1 << 20,) * 4)
    # tp_size 4 with lcm 8: split 2, groups of rank 3 are 6, 7; tp_size 2 rank 0 holds 0..3.
    assert keys.namespaced_prefix(
        dataclasses.replace(tp4_as_split, object_bytes=(1,))
    ) == keys.namespaced_prefix(dataclasses.replace(tp2_8, object_bytes=(1,)))


@pytest.mark.parametrize(
    "identity, expected",
    [
        (BASE, [f"{HASH}_1_k", f"{HASH}_1_v"]),
        (dataclasses.replace(BASE, pp_size=2, pp_rank=1), [f"{HASH}_1_1_k", f"{HASH}_1_1_v"]),
        (dataclasses.replace(BASE, is_mla=True), [f"{HASH}__k"]),
        (dataclasses.replace(BASE, is_mla=True, pp_size=4, pp_rank=3), [f"{HASH}_3_k"]),
        (dataclasses.replace(BASE, extra_backend_tag="blue"), [f"blue_{HASH}_1_k", f"blue_{HASH}_1_v"]),
    ],
    ids=["mha", "mha-pp", "mla", "mla-pp", "tagged"],
)
def test_legacy_keys_are_the_in_tree_backends(identity, expected):
    got = keys.object_keys(keys.legacy_prefix(identity), [HASH], keys.legacy_suffixes(identity))
    assert got == expected


def test_legacy_refuses_what_the_in_tree_backend_cannot_name():
    assert keys.legacy_refusal(BASE) is None
    assert "head groups" in keys.legacy_refusal(
        dataclasses.replace(BASE, layout="page_head", tp_lcm_size=4)
    )
    assert "hybrid" in keys.legacy_refusal(dataclasses.replace(BASE, pool="mamba"))
    with pytest.raises(ValueError, match="key_scheme 'namespaced'"):
        keys.legacy_suffixes(BASE, chunks=2)


def test_keys_stay_within_the_limit_whatever_the_model_name():
    huge = dataclasses.replace(BASE, model_name="/models/" + "x" * 5000, extra_backend_tag="t" * 64)
    prefix = keys.namespaced_prefix(huge)
    suffixes = keys.namespaced_suffixes(huge, chunks=3)
    budget = keys.max_page_key_bytes(prefix, suffixes)
    assert budget >= 64  # a SGLang page hash always fits
    for k in keys.object_keys(prefix, [HASH], suffixes):
        assert len(k.encode()) <= MAX_KEY_BYTES


def test_chunk_suffixes_follow_their_object():
    assert keys.namespaced_suffixes(BASE, chunks=2) == (".k.c0", ".k.c1", ".v.c0", ".v.c1")


@pytest.mark.parametrize(
    "page_key, ok",
    [(HASH[:10], True), ("", False), (None, False), (123, False), ("x" * 10, True), ("x" * 11, False), ("é" * 5, True), ("é" * 6, False)],
    ids=["hash", "empty", "none", "int", "at-budget", "over-budget", "utf8-fits", "utf8-over"],
)
def test_key_fits_counts_bytes(page_key, ok):
    assert keys.key_fits(page_key, 10) is ok


@pytest.mark.parametrize(
    "batch, ok",
    [([HASH[:10]] * 3, True), ([], True), ([HASH[:10], ""], False), ([HASH[:10], None], False),
     (["x" * 11], False), (["é" * 5, "a"], True), (["é" * 6], False), (["\ud800"], False)],
    ids=["hashes", "empty", "one-empty", "one-none", "over-budget", "utf8-fits", "utf8-over", "lone-surrogate"],
)
def test_a_batch_fits_exactly_when_every_key_does(batch, ok):
    assert keys.keys_fit(batch, 10) is ok
    assert all(keys.key_fits(k, 10) for k in batch) is ok


@pytest.mark.parametrize(
    "batch, ok",
    [(["ab", "cd", "ef"], True), (["abc", "d", "ef"], True), (["a", "bcdef", "f"], False),
     (["ab", "c\nd"[:2], "ef"], True), (["ab", "c\n", "ef"], True), (["ab\ncd", "ef"], False), (["a\nb", "cde"], True),
     (["ab", "", "cdef"], False), (["ab", "cd", "e" * 11], False), (["a" * 11] * 3, False),
     (["ab", "é", "cd"], True), (["ab", "cd", None], False), (["\n", "\n"], True)],
    ids=["uniform", "same-total", "one-over", "newline-uniform", "newline-end", "newline-over", "newline-2",
         "empty-inside", "last-over", "all-over", "utf8-inside", "none-last", "newlines-only"],
)
def test_the_one_length_shortcut_never_passes_a_batch_the_per_key_rule_refuses(batch, ok):
    """The batch check proves 'every key one width' from one join; batches
    built to fool it (same total length, newlines inside keys, an empty key
    between longer ones) get the per-key rule's answer."""
    budget = 4
    assert keys.keys_fit(batch, budget) is ok
    assert all(keys.key_fits(k, budget) for k in batch) is ok


def test_key_fits_defaults_to_simms_limit():
    assert keys.key_fits("k" * MAX_KEY_BYTES) and not keys.key_fits("k" * (MAX_KEY_BYTES + 1))
    assert not keys.key_fits("\ud800")  # no UTF-8 form: no key (and no exception)


def test_a_pools_dtype_names_every_regions_dtype_where_they_differ():
    assert keys.pool_dtype("torch.bfloat16", ["torch.bfloat16"]) == "torch.bfloat16"  # KV keys unchanged
    mixed = keys.pool_dtype("torch.bfloat16", ["torch.float32", "torch.bfloat16"])
    assert mixed == "torch.bfloat16[torch.float32,torch.bfloat16]"
    assert mixed != keys.pool_dtype("torch.bfloat16", ["torch.float16", "torch.bfloat16"])
