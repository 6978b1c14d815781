"""Measurement 2: set and get bandwidth of ours on the local store, against a same-run torch copy of the same bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglang_simm_dev.bench.backends import make_ours
from sglang_simm_dev.bench.checks import Checks, check_result
from sglang_simm_dev.bench.overhead import OVERHEAD_GEOMETRY
from sglang_simm_dev.bench.pages import bytes_of, fill_pool, host_indices, page_keys
from sglang_simm_dev.bench.timing import median, time_samples
from sglang_simm_dev.pools import PRESETS, ModelGeometry, build_host_pool

#: Bandwidth cases: (label, geometry). Object sizes 1 MiB, 4 MiB (K and V), 4.3 MiB (MLA).
BANDWIDTH_CASES: dict[str, ModelGeometry] = {
    "1mib": ModelGeometry("bench-1mib", layer_num=8, head_num=8, head_dim=128, page_size=64),
    "llama3-8b": PRESETS["llama3-8b"],
    "deepseek-v3": PRESETS["deepseek-v3"],
    # for smoke tests: 32 KiB objects
    "small": OVERHEAD_GEOMETRY,
}


class BandwidthRig:
    """Our backend on the local store over a pool of real-size pages."""

    def __init__(self, label: str, geom: ModelGeometry, pages: int, *, capacity: int):
        self.label = label
        self.geom = geom
        self.pages = pages
        self.pool = build_host_pool(geom, tokens=pages * geom.page_size)
        fill_pool(self.pool, seed=len(label))
        host_pages = int(self.pool.size) // geom.page_size
        self.src_pages = list(range(pages))
        self.dst_pages = list(range(pages, min(2 * pages, host_pages)))
        self.ours = make_ours(self.pool, geom, "local", capacity=capacity)
        b = self.ours.pools.kv
        self.object_sizes = sorted(set(b.sizes_list))
        self.page_bytes = b.page_bytes
        self.keys = page_keys(pages, f"bw-{label}")
        self.src = host_indices(self.src_pages, geom.page_size)
        self.dst = host_indices(self.dst_pages, geom.page_size)
        # the same bytes as torch tensors: every object of the source pages,
        # sliced out of the host pool's buffer
        starts = np.asarray(self.src_pages, dtype=np.int64) * geom.page_size
        ptrs = b.geometry.pointers(starts).tolist()
        sizes = b.sizes_list * pages
        whole = self.pool.kv_buffer.view(-1).view(torch.uint8)
        base = whole.data_ptr()
        self.torch_src = [whole[p - base:p - base + s] for p, s in zip(ptrs, sizes)]
        self.torch_dst = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        for t in self.torch_dst:  # touch the pages once
            t.fill_(0)

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def set(self) -> list[bool]:
        return self.ours.batch_set_v1(self.keys, self.src)

    def get(self) -> list[bool]:
        return self.ours.batch_get_v1(self.keys, self.dst)

    def unset(self) -> None:
        self.ours.clear()

    def torch_copy(self) -> None:
        """``copy_`` of every object, torch's default intra-op threads."""
        for d, s in zip(self.torch_dst, self.torch_src):
            d.copy_(s)

    def torch_copy_1t(self) -> None:
        """The same on one thread: on busy cores the default one's thread
        barrier can collapse, so the better of the two is the limit."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.torch_copy()
        finally:
            torch.set_num_threads(threads)

    def verify(self, checks: Checks) -> None:
        buf = bytes_of(self.pool.kv_buffer)
        ps = self.geom.page_size
        n = len(self.dst_pages)
        buf = buf.numpy()
        if self.geom.is_mla:
            a, b = buf[: n * ps], buf[n * ps: 2 * n * ps]
        else:
            a, b = buf[:, : n * ps], buf[:, n * ps: 2 * n * ps]
        checks.expect(f"bandwidth/{self.label}/bytes", np.array_equal(a, b), "pages read back different bytes")

    def close(self) -> None:
        self.ours.close()
        self.torch_src = self.torch_dst = []


def measure_bandwidth(rig: BandwidthRig, repeat: int, checks: Checks, *, warmup: int = 1) -> dict[str, Any]:
    rig.unset()
    check_result(checks, f"bandwidth/{rig.label}/set", "set", rig.set(), rig.pages)
    check_result(checks, f"bandwidth/{rig.label}/get", "get", rig.get(), len(rig.dst_pages))
    rig.verify(checks)
    # set: ours (fresh pages every sample) against torch; get: the pages stay stored
    baselines = {"torch": rig.torch_copy, "torch-1t": rig.torch_copy_1t}
    set_s = time_samples({"ours": rig.set, **baselines}, repeat=repeat, warmup=warmup,
                         setup={"ours": rig.unset}, loop=False)
    rig.unset()
    check_result(checks, f"bandwidth/{rig.label}/set", "set", rig.set(), rig.pages)
    get_s = time_samples({"ours": rig.get, **baselines}, repeat=repeat, warmup=warmup, loop=False)
    check_result(checks, f"bandwidth/{rig.label}/get", "get", rig.get(), len(rig.dst_pages))
    rig.verify(checks)
    gb = rig.nbytes / 1e9
    torch_default = gb / median(set_s["torch"] + get_s["torch"])
    torch_one = gb / median(set_s["torch-1t"] + get_s["torch-1t"])
    row = {
        "case": rig.label, "model": rig.geom.name, "pages": rig.pages,
        "object_bytes": rig.object_sizes, "page_bytes": rig.page_bytes, "bytes": rig.nbytes,
        "set_gbps": gb / median(set_s["ours"]), "get_gbps": gb / median(get_s["ours"]),
        "torch_gbps": max(torch_default, torch_one),
        "torch_default_threads_gbps": torch_default, "torch_one_thread_gbps": torch_one,
    }
    row["set_ratio"] = row["set_gbps"] / row["torch_gbps"]
    row["get_ratio"] = row["get_gbps"] / row["torch_gbps"]
    return row
