"""One TP rank of a two-process SGLang HiCache, driven by tests/store/test_tp2.py.

    python tp_rank.py '{"rank": 0, "size": 2, "init": "file:///...", "pages": 12,
                        "runs": [{"model": "mla", "manager": "local://x"}, ...]}'

SGLang's own ``HybridCacheController`` (its backup, prefetch and prefetch-IO
threads, its gloo group of two for the MIN all-reduce of hits) over this
rank's host pool and our backend. The rank writes a prompt's pages, waits
for the other rank, looks the prompt up again, loads the hit into fresh host
slots and checks every byte. Prints one JSON line.

Page bytes: an MLA model's pages are the same on every rank (the same
pattern, written by rank 0 only, as SGLang does); an MHA model's pages hold
the rank's own heads (a pattern per rank), so a rank that loaded the other
rank's pages would fail the check.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def one_run(rank: int, size: int, init: str, pages: int, model: str, manager: str) -> dict:
    import torch.distributed as dist

    from sglang_simm_dev.demo.common import PageHasher, PagePattern
    from sglang_simm_dev.demo.drivers import ControllerDriver
    from sglang_simm_dev.pools import PRESETS

    if model == "mla":
        geom = dataclasses.replace(PRESETS["deepseek-v3"], page_size=4)
        seed = 0x51AA
    else:
        geom = PRESETS["tiny"]
        seed = 0x51AA + 1000 * rank
    ps = geom.page_size
    hasher = PageHasher()
    driver = ControllerDriver(
        geom, "page_first", 4 * pages, {"manager_address": manager}, hasher, 60.0,
        tp=(rank, size), init_method=init, enable_metrics=False,
    )
    try:
        tokens = list(range(1000, 1000 + pages * ps))
        keys = hasher(tokens, ps)
        pattern = PagePattern(geom.page_bytes(), seed=seed)
        slots = driver.alloc(len(tokens))
        for p in range(pages):
            pattern.fill(driver.host, int(slots[p * ps]), keys[p])
        stored, _ = driver.write(keys, tokens, slots, lambda n: None)
        dist.barrier()  # the writer's pages are in the store
        hits, loaded, indices, _, _ = driver.fetch("tp-test", tokens, keys, None, lambda n: None)
        mismatched = [
            p for p in range(loaded) if pattern.check(driver.host, int(indices[p * ps]), keys[p]) is not None
        ]
        stats = driver.backend_stats()
        result = {
            "model": model, "manager": manager, "rank": rank, "stored": stored, "hits": hits,
            "loaded": loaded, "mismatched": mismatched,
            "pages_written": stats.get("pages_written", 0), "pages_read": stats.get("pages_read", 0),
            "writer": bool(driver.cc.storage_config.is_storage_writer),
        }
        dist.barrier()  # both ranks done with the store before the next run
        return result
    finally:
        driver.close()


def main() -> None:
    args = json.loads(sys.argv[1])
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=args["init"], rank=args["rank"], world_size=args["size"])
    try:
        for run in args["runs"]:
            result = one_run(args["rank"], args["size"], args["init"], args["pages"], run["model"], run["manager"])
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
