#!/usr/bin/env bash
# SGLang 0.5.11+: `pip install sglang-simm` registers the backend name `simm`
# through SGLang's plugin entry points; no SGLang edit, no module path.
# Edit MODEL and the manager address (host:port of the SiMM cluster manager,
# or "local" for the local store on one machine).
set -euo pipefail
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
  --hicache-storage-backend-extra-config '{"manager_address": "10.0.0.1:30001", "extra_backend_tag": "prod"}'
)
exec python -m sglang.launch_server "${args[@]}"
