#!/usr/bin/env bash
# Any SGLang 0.5.8+: the dynamic route names the module and class.
# "interface_v1": 1 selects SGLang's zero-copy page path; without it SGLang
# silently falls back to a slow copying path (the backend warns).
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
args=(
  --model-path "$MODEL"
  --enable-hierarchical-cache
  --hicache-mem-layout page_first
  --hicache-ratio 2                          # needs twice the GPU KV pool in free host memory, or SGLang refuses to start (launch_plugin.sh)
  --hicache-storage-prefetch-policy timeout  # wait for L3 reads, up to a bound
  --hicache-write-policy write_through       # pages go to L3 as soon as they are computed
  --hicache-storage-backend dynamic
  --hicache-storage-backend-extra-config '{"backend_name": "simm", "module_path": "sglang_simm", "class_name": "HiCacheSiMM", "interface_v1": 1, "manager_address": "10.0.0.1:30001"}'
)
exec python -m sglang.launch_server "${args[@]}"
