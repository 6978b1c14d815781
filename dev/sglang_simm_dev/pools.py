"""Real SGLang host KV pools and storage configs, built on the CPU.

The demo, the benchmarks and the tests all need SGLang's own host pool
classes, not look-alikes. Their constructors changed across releases, so the
differences live here, in one place:

* 0.5.2x: the device pool describes itself (``MHABufferInfo`` /
  ``get_device_pool_infos``) and the host pool is built from that;
* older: the host pool takes the device pool object itself.

``pin_memory=False`` everywhere: pinning needs a GPU driver.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelGeometry:
    """The KV geometry of one rank of a model."""

    name: str
    layer_num: int
    #: MHA: KV heads on this rank; MLA: 1
    head_num: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    is_mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def page_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        if self.is_mla:
            return self.layer_num * self.page_size * (self.kv_lora_rank + self.qk_rope_head_dim) * item
        return 2 * self.layer_num * self.page_size * self.head_num * self.head_dim * item


#: Geometry presets, one TP rank each.
PRESETS: dict[str, ModelGeometry] = {
    "llama3-8b": ModelGeometry("meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128, 64),
    "llama3-70b-tp4": ModelGeometry("meta-llama/Llama-3.1-70B-Instruct", 80, 2, 128, 64),
    "qwen3-32b-tp2": ModelGeometry("Qwen/Qwen3-32B", 64, 4, 128, 64),
    "deepseek-v3": ModelGeometry(
        "deepseek-ai/DeepSeek-V3", 61, 1, 576, 64, is_mla=True, kv_lora_rank=512, qk_rope_head_dim=64
    ),
    "tiny": ModelGeometry("tiny-test-model", 2, 2, 16, 4),
}


def build_device_pool(geom: ModelGeometry, tokens: int) -> Any:
    from sglang.srt.mem_cache import memory_pool as mp

    common = dict(size=tokens, page_size=geom.page_size, dtype=geom.dtype, layer_num=geom.layer_num,
                  device="cpu", enable_memory_saver=False)
    if geom.is_mla:
        return _call(mp.MLATokenToKVPool, kv_lora_rank=geom.kv_lora_rank,
                     qk_rope_head_dim=geom.qk_rope_head_dim, **common)
    return _call(mp.MHATokenToKVPool, head_num=geom.head_num, head_dim=geom.head_dim,
                 enable_alt_stream=False, **common)


def build_host_pool(
    geom: ModelGeometry,
    *,
    tokens: int,
    layout: str = "page_first",
    ratio: float = 2.0,
    device_pool: Any = None,
) -> Any:
    """A real host pool holding ``ratio * tokens`` token slots (page-rounded)."""
    if device_pool is None:
        device_pool = build_device_pool(geom, tokens)
    common = dict(host_to_device_ratio=ratio, host_size=0, page_size=geom.page_size, layout=layout,
                  pin_memory=False, device="cpu")
    try:
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    except ImportError:
        assembler = None
    if assembler is not None and hasattr(assembler, "_mha_host_inputs"):
        if geom.is_mla:
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            return MLATokenToKVPoolHost(
                device_pool.get_device_pool_infos()[0].buffer_info,
                device_capacity_tokens=device_pool.size,
                start_layer=device_pool.start_layer,
                end_layer=device_pool.end_layer,
                target_layer_num=device_pool.layer_num,
                override_kv_cache_dim=device_pool.kv_cache_dim,
                **common,
            )
        host_cls, host_input, host_kwargs = assembler._mha_host_inputs(device_pool)
        return host_cls(host_input, **host_kwargs, **common)
    return _call(_host_pool_class(geom.is_mla), device_pool=device_pool, **common)


def _host_pool_class(is_mla: bool) -> Any:
    """SGLang's MHA or MLA host pool class, wherever the release keeps it:
    ``memory_pool_host`` up to 0.5.1x, ``pool_host.mha`` / ``pool_host.mla``
    after (0.5.22 still has a ``memory_pool_host`` module, without them)."""
    import importlib

    name = "MLATokenToKVPoolHost" if is_mla else "MHATokenToKVPoolHost"
    places = ("sglang.srt.mem_cache.pool_host." + ("mla" if is_mla else "mha"),
              "sglang.srt.mem_cache.memory_pool_host")
    for place in places:
        try:
            cls = getattr(importlib.import_module(place), name, None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise ImportError(f"this SGLang has no {name} in {' or '.join(places)}")


#: the Mamba state pool of :func:`mamba_pool`: layers, and device slots (the
#: host pool holds twice that, plus one)
MAMBA_LAYERS = 2
MAMBA_CAPACITY = 8


def mamba_pool(*, temporal=(2, 4, 4), convs=((3, 8), (5,)), extra=(), temporal_dtype=torch.float32) -> Any:
    """SGLang's ``MambaPoolHost`` (0.5.2x) in the page-first layout, over
    Mamba state buffers of ``MAMBA_CAPACITY`` device slots: a temporal state
    of shape ``temporal`` (float32 by default), bfloat16 conv states of shapes
    ``convs``, and ``extra`` per-slot side states
    (``MambaStateBufferInfo.extra_checkpoint_buffers``)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, MAMBA_CAPACITY, *temporal, dtype=temporal_dtype),
        conv=tuple(torch.zeros(MAMBA_LAYERS, MAMBA_CAPACITY, *c, dtype=torch.bfloat16) for c in convs),
        extra_checkpoint_buffers=tuple(extra),
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=MAMBA_CAPACITY, pin_memory=False, device="cpu", layout="page_first"
    )


def storage_config(**fields: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` with sensible defaults for one rank,
    keeping only the fields the installed release has. The defaults are
    SGLang's own where it has one (metrics off)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny-test-model", extra_config={},
    )
    values.update(fields)
    known = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
    unknown = set(fields) - known
    if unknown - {"attn_cp_rank", "attn_cp_size", "dcp_size", "dcp_rank", "dp_rank", "logical_page_size"}:
        raise TypeError(f"HiCacheStorageConfig has no field(s) {sorted(unknown)}")
    return HiCacheStorageConfig(**{k: v for k, v in values.items() if k in known})


def create_backend(route: str, host: Any, *, manager_address: str, **fields: Any) -> Any:
    """The backend as SGLang's cache controller attaches it to the host KV
    pool ``host``: ``StorageBackendFactory.create_backend(route, config,
    host)``, then ``register_mem_pool_host(host)``. ``route`` is ``simm``
    (the plugin route, where the release loads plugins) or ``dynamic``
    (every release: the backend named by module and class); ``fields`` are
    the storage config's (:func:`storage_config`), ``extra_config`` merged
    under the store address."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra: dict[str, Any] = {"manager_address": manager_address, **fields.pop("extra_config", {})}
    if route == "dynamic":
        extra.update(backend_name="simm", module_path="sglang_simm", class_name="HiCacheSiMM", interface_v1=1)
    backend = StorageBackendFactory.create_backend(route, storage_config(extra_config=extra, **fields), host)
    try:
        backend.register_mem_pool_host(host)
    except BaseException:
        backend.close()  # a refused pool: nothing of this backend stays open
        raise
    return backend


def _call(fn: Any, /, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts, mapping
    the first positional parameter name where releases renamed it."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    accepted = {k: v for k, v in kwargs.items() if k in params}
    if "device_pool" in kwargs and "device_pool" not in params:
        first = next(n for n in params if n != "self")
        accepted[first] = kwargs["device_pool"]
    return fn(**accepted)
