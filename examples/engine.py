"""Offline inference with SGLang's Engine and SiMM as the HiCache L3 tier.

    MANAGER=local python examples/engine.py        # local store, one machine
    MANAGER=10.0.0.1:30001 python examples/engine.py

Needs a GPU and a model; `bash scripts/demo.sh` (from a clone) shows the data path without one.
"""

import json
import os

import sglang as sgl


def main() -> None:
    extra = {"manager_address": os.environ.get("MANAGER", "local"), "extra_backend_tag": "engine-demo"}
    llm = sgl.Engine(
        model_path=os.environ.get("MODEL", "meta-llama/Llama-3.1-8B-Instruct"),
        enable_hierarchical_cache=True,
        hicache_mem_layout="page_first",
        # a host pool twice the GPU KV pool: needs that much free host memory (twice the GPU KV
        # pool's bytes, beyond the 10 GiB SGLang keeps free), else SGLang refuses to start
        # ("Not enough host memory available"); on a small host lower it or give hicache_size (GB)
        hicache_ratio=2,
        # a request waits for its L3 read, up to a bound; best_effort (the default before SGLang
        # 0.5.23) cuts most L3 reads short
        hicache_storage_prefetch_policy="timeout",
        hicache_write_policy="write_through",  # pages go to L3 as soon as they are computed
        hicache_storage_backend="simm",  # SGLang 0.5.11+; older: "dynamic", see launch_dynamic.sh
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    shared = "You are a careful assistant. " * 200  # a long shared prefix: stored once, reused
    for question in ("What is KV caching?", "Why offload it to a remote store?"):
        out = llm.generate(shared + question, {"max_new_tokens": 64, "temperature": 0})
        print(out["text"])
    llm.shutdown()


if __name__ == "__main__":
    main()
