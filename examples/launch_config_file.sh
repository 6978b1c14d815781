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
  # a host pool twice the GPU KV pool: needs that much free host memory per
  # server (twice the GPU KV pool's bytes, beyond the 10 GiB SGLang keeps
  # free), else SGLang refuses to start ("Not enough host memory available");
  # on a small host lower it or give --hicache-size GB
  --hicache-ratio 2
  # a request waits for its L3 read, up to a bound (wait_complete: no bound);
  # best_effort, the default before SGLang 0.5.23, cuts most L3 reads short
  --hicache-storage-prefetch-policy timeout
  # pages go to L3 as soon as they are computed, not when the GPU evicts them
  --hicache-write-policy write_through
  --hicache-storage-backend simm
  --hicache-storage-backend-extra-config "@$HERE/simm-config.json"
)
exec python -m sglang.launch_server "${args[@]}"
