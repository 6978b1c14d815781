#!/usr/bin/env bash
# The same settings from a file: SGLang 0.5.9+ reads `@path` (JSON, YAML or
# TOML) for --hicache-storage-backend-extra-config. Alternatively point
# SGLANG_HICACHE_SIMM_CONFIG_PATH at a JSON file (any release); values given
# in the extra config win over the file, and the file over environment
# variables such as SIMM_CLUSTER_MANAGER.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
args=(
  --model-path "$MODEL"
  --enable-hierarchical-cache
  --hicache-mem-layout page_first
  --hicache-ratio 2                          # needs twice the GPU KV pool in free host memory, or SGLang refuses to start (launch_plugin.sh)
  --hicache-storage-prefetch-policy timeout  # wait for L3 reads, up to a bound
  --hicache-write-policy write_through       # pages go to L3 as soon as they are computed
  --hicache-storage-backend simm
  --hicache-storage-backend-extra-config "@$HERE/simm-config.json"
)
exec python -m sglang.launch_server "${args[@]}"
