#!/usr/bin/env bash
# Any SGLang 0.5.8+: the dynamic route names the module and class.
# "interface_v1": 1 selects SGLang's zero-copy page path; without it SGLang
# silently falls back to a slow copying path (the backend warns).
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --enable-hierarchical-cache \
  --hicache-mem-layout page_first \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config '{"backend_name": "simm", "module_path": "sglang_simm", "class_name": "HiCacheSiMM", "interface_v1": 1, "manager_address": "10.0.0.1:30001"}'
