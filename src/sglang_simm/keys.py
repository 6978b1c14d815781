"""Object keys: which SiMM key holds which part of which KV page.

Pure functions, no I/O. A page's object key is always
``prefix + page_hash + part_suffix``, so a batch of keys is one concatenation
per object, and the two schemes differ only in the prefix and the suffixes.

``namespaced`` (default): the prefix carries a fingerprint of everything that
gives a page's bytes their meaning (model, parallel layout, page geometry,
dtype, memory layout, tag). Any mismatch between two servers sharing a
cluster is then a miss, never a wrong page.

``legacy``: byte-for-byte the keys of SGLang's in-tree ``HiCacheSiMM``
(``{tag}_{hash}_{tp_rank}[_{pp_rank}]_k|v``, MLA ``{hash}_[{pp_rank}]_k``), so
a fleet can move over while sharing one cluster. Those keys carry no model,
TP size or geometry: two models, or one model at two TP sizes, on one cluster
read each other's pages. Use it only for a migration.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal, Sequence

from sglang_simm.errors import MAX_KEY_BYTES, UnsupportedPoolError
from sglang_simm.simm_rules import key_fits, keys_fit  # noqa: F401 (SiMM's key rule, re-exported)

KeyScheme = Literal["namespaced", "legacy"]
KEY_SCHEMES: tuple[str, ...] = ("namespaced", "legacy")

#: Bumped whenever the meaning of a namespaced key changes, so old objects
#: become misses instead of being misread.
NAMESPACE_VERSION = 1

#: The start of every key of a start-up round trip (``client.KVClient.warmup``;
#: SGLang's in-tree backend's too), never a page's: the local store counts
#: these objects apart, so pages counted from its counters leave them out.
WARMUP_KEY_PREFIX = "sglang_simm_warmup_"
#: What the breaker's probe looks up (``backend``): never stored, so a
#: healthy store answers "not found", which is no fault.
PROBE_KEY = f"{WARMUP_KEY_PREFIX}breaker_probe"


@dataclass(frozen=True)
class PageIdentity:
    """Everything that makes a stored page's bytes mean something."""

    model_name: str
    is_mla: bool
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    page_size: int
    dtype: str
    layout: str
    #: bytes of each object of one page, in part order
    object_bytes: tuple[int, ...]
    extra_backend_tag: str | None = None
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    #: heterogeneous-TP sharing: heads are stored in ``tp_lcm_size`` groups
    tp_lcm_size: int | None = None
    #: what the page holds: "kv", or a hybrid side pool's name
    pool: str = "kv"

    @property
    def head_grouped(self) -> bool:
        """Pages named by head group of ``tp_lcm_size`` instead of by TP rank,
        so ranks of different TP sizes share them (``page_head`` only)."""
        return bool(self.tp_lcm_size) and not self.is_mla

    @property
    def split_factor(self) -> int:
        """How many head groups one rank holds (1: its page is one group)."""
        if self.head_grouped and self.tp_lcm_size > self.tp_size:
            return self.tp_lcm_size // self.tp_size
        return 1


def pool_dtype(pool_dtype: str, region_dtypes: Sequence[str]) -> str:
    """The ``dtype`` a pool's keys carry: the pool's own, followed by its
    regions' where any differs from it (a Mamba pool's ``dtype`` is its conv
    state's; a bf16 and an fp16 temporal state must not share keys)."""
    if all(d == pool_dtype for d in region_dtypes):
        return pool_dtype
    return f"{pool_dtype}[{','.join(region_dtypes)}]"


def fingerprint(identity: PageIdentity) -> str:
    """16 hex digits over the identity fields that decide a page's bytes,
    normalised so that ranks holding identical bytes agree: no TP for MLA
    (replicated), only ``tp_lcm_size`` for head groups (named in the suffix).
    """
    fields = asdict(identity)
    fields["v"] = NAMESPACE_VERSION
    if identity.is_mla:
        fields["tp_size"] = fields["tp_rank"] = fields["tp_lcm_size"] = None
    elif identity.head_grouped:
        # A rank's page is split_factor (K, V) groups; name the group's bytes.
        fields["tp_size"] = fields["tp_rank"] = None
        fields["object_bytes"] = list(identity.object_bytes[:2])
    else:
        fields["tp_lcm_size"] = None
    if identity.pp_size <= 1:
        fields["pp_rank"] = 0
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def namespaced_prefix(identity: PageIdentity) -> str:
    # The tag leads so an operator can still tell tenants apart by eye.
    tag = f"{identity.extra_backend_tag}/" if identity.extra_backend_tag else ""
    return f"{tag}s{NAMESPACE_VERSION}.{fingerprint(identity)}/"


def namespaced_suffixes(identity: PageIdentity, chunks: int = 1) -> tuple[str, ...]:
    """Suffix of every object of one page, in the order the host pool's
    ``get_page_buffer_meta`` lists them (K then V per head group; MLA one).
    The chunk index comes last: chunks of one object are adjacent in memory.
    """
    if identity.is_mla:
        parts = [".kv"]
    elif identity.head_grouped:
        first = identity.tp_rank * identity.split_factor
        parts = []
        for group in range(first, first + identity.split_factor):
            head = f".h{group}of{identity.tp_lcm_size}"
            parts += [f"{head}.k", f"{head}.v"]
    else:
        parts = [".k", ".v"]
    if identity.pool != "kv":
        parts = [f".{identity.pool}{p}" for p in parts]
    return _chunked(parts, chunks)


def named_part_suffixes(identity: PageIdentity, names: Sequence[str], chunks: int = 1) -> tuple[str, ...]:
    """Suffixes of a hybrid side pool whose page objects are not K/V halves
    (Mamba: ``temporal``, ``conv0``, ...; a DSA indexer: one object), in the
    order of the pool's ``get_page_buffer_meta``: ``.{pool}.{name}``."""
    if identity.pool == "kv":
        raise ValueError("named parts are for hybrid side pools, not the KV pool")
    return _chunked([f".{identity.pool}.{name}" for name in names], chunks)


def legacy_prefix(identity: PageIdentity) -> str:
    return f"{identity.extra_backend_tag}_" if identity.extra_backend_tag else ""


def legacy_suffixes(identity: PageIdentity, chunks: int = 1) -> tuple[str, ...]:
    """The in-tree backend's suffixes, reproduced exactly."""
    if chunks != 1:
        raise ValueError(
            "key_scheme 'legacy' cannot split objects over SiMM's value limit: "
            "the in-tree backend never did; use key_scheme 'namespaced'"
        )
    enable_pp = identity.pp_size > 1
    if identity.is_mla:
        suffix = f"{identity.pp_rank}" if enable_pp else ""
        return (f"_{suffix}_k",)
    suffix = f"{identity.tp_rank}_{identity.pp_rank}" if enable_pp else f"{identity.tp_rank}"
    return (f"_{suffix}_k", f"_{suffix}_v")


def legacy_refusal(identity: PageIdentity) -> str | None:
    """Why the legacy scheme cannot serve this identity, or None: the
    in-tree backend has no key for it, and reusing one would mix bytes."""
    if identity.pool != "kv":
        return f"hybrid side pool {identity.pool!r} has no in-tree key"
    if identity.head_grouped:
        return "head groups (tp_lcm_size with page_head) have no in-tree key"
    if identity.dcp_size > 1 or identity.attn_cp_size > 1:
        return "decode/attention context parallelism has no in-tree key"
    return None


def key_layout(
    identity: PageIdentity, scheme: str, chunks: int = 1, part_names: Sequence[str] | None = None
) -> tuple[str, tuple[str, ...]]:
    """The key prefix of a pool and the suffix of every object of its pages
    under ``scheme``; ``part_names`` names a side pool's objects when they
    are not K/V halves. Raises UnsupportedPoolError where the scheme has no
    key for the pool."""
    if scheme == "legacy":
        refusal = legacy_refusal(identity)
        if refusal:
            raise UnsupportedPoolError(
                f"key_scheme 'legacy' cannot be used here: {refusal}; use key_scheme 'namespaced'"
            )
        return legacy_prefix(identity), legacy_suffixes(identity, chunks)
    if part_names is not None:
        return namespaced_prefix(identity), named_part_suffixes(identity, part_names, chunks)
    return namespaced_prefix(identity), namespaced_suffixes(identity, chunks)


def _chunked(parts: Sequence[str], chunks: int) -> tuple[str, ...]:
    if chunks == 1:
        return tuple(parts)
    return tuple(f"{p}.c{i}" for p in parts for i in range(chunks))


def object_keys(prefix: str, page_keys: Sequence[str], suffixes: Sequence[str]) -> list[str]:
    """Flat, page-major list: every suffix of page 0, then page 1, ..."""
    return [f"{prefix}{k}{s}" for k in page_keys for s in suffixes]


def max_page_key_bytes(prefix: str, suffixes: Sequence[str]) -> int:
    """The longest page hash that still gives keys within SiMM's limit."""
    longest = max(len(s.encode()) for s in suffixes)
    return MAX_KEY_BYTES - len(prefix.encode()) - longest
