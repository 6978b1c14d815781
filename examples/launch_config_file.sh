#!/usr/bin/env bash
# The same settings from a file: SGLang 0.5.9+ reads `@path` (JSON, YAML or
# TOML) for --hicache-storage-backend-extra-config. Alternatively point
# SGLANG_HICACHE_SIMM_CONFIG_PATH at a JSON file (any release); values given
# in the extra config win over the file, and the file over environment
# variables such as SIMM_CLUSTER_MANAGER.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --enable-hierarchical-cache \
  --hicache-mem-layout page_first \
  --hicache-storage-backend simm \
  --hicache-storage-backend-extra-config "@$HERE/simm-config.json"
