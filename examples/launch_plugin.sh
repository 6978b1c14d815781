#!/usr/bin/env bash
# SGLang 0.5.11+: `pip install sglang-simm` registers the backend name `simm`
# through SGLang's plugin entry points; no SGLang edit, no module path.
# Edit MODEL and the manager address (host:port of the SiMM cluster manager,
# or "local" for the local store on one machine).
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --enable-hierarchical-cache \
  --hicache-mem-layout page_first \
  --hicache-storage-backend simm \
  --hicache-storage-backend-extra-config '{"manager_address": "10.0.0.1:30001", "extra_backend_tag": "prod"}'
