"""The CPU stand-ins the e2e servers run with: their semantics, and that they
stay out of processes that do not ask for them. Unit tests: no server."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch

from sglang_simm_dev import cpu_standins


def test_this_process_has_no_server_standins():
    # The unit tests build SGLang's host pools in this process: they must see
    # SGLang's own classes.
    assert not any(isinstance(f, cpu_standins._PatchOnImport) for f in sys.meta_path)
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    assert not getattr(HostKVCache.__init__, "__cpu_standin__", False)
    assert not getattr(MHATokenToKVPoolHost.load_to_device_per_layer, "__cpu_standin__", False)
    assert "sgl_kernel" not in sys.modules or not getattr(sys.modules["sgl_kernel"], "__cpu_standin__", False)


def test_the_venvs_import_shims_load_from_the_dev_package_at_start():
    # scripts/_venv.sh's .pth imports sglang_simm_dev, which is not in the
    # wheel: it must be read after the .pth that puts dev/ on the path.
    if not os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], "_sglang_cpu_test_shims.pth")):
        pytest.skip("not a venv of scripts/_venv.sh")
    code = "import sys; print(sorted({type(f).__name__ for f in sys.meta_path}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "_TorchvisionHook" in out.stdout, out.stdout


def test_assign_req_to_token_pool_matches_the_triton_kernels_semantics():
    req_to_token = torch.zeros((4, 10), dtype=torch.int32)
    cpu_standins.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 4]),
        torch.tensor([4, 6]),
        torch.tensor([11, 12, 13, 21, 22]),
        10,
    )
    assert req_to_token[2].tolist() == [0, 11, 12, 13, 0, 0, 0, 0, 0, 0]
    assert req_to_token[0].tolist() == [0, 0, 0, 0, 21, 22, 0, 0, 0, 0]
    assert req_to_token[[1, 3]].sum() == 0


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_in_place():
    a = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    b = torch.arange(6 * 3, dtype=torch.int64).view(6, 3) + 1000
    want_a, want_b = a.clone(), b.clone()
    tgt, src = torch.tensor([0, 1, 5]), torch.tensor([1, 5, 0])  # overlapping: a rotation
    want_a[tgt] = want_a[src].clone()
    want_b[tgt] = want_b[src].clone()
    ptrs = torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([8 * 4, 3 * 8], dtype=torch.int64)
    cpu_standins.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


_HOST_POOL_ROUND_TRIP = textwrap.dedent(
    """
    import ctypes
    import torch
    from sglang_simm_dev import cpu_standins
    cpu_standins.install_server_standins()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang_simm_dev.pools import ModelGeometry, build_device_pool, build_host_pool

    assert MHATokenToKVPoolHost.load_to_device_per_layer.__cpu_standin__
    geom = ModelGeometry("standin-check", 3, 2, 8, 4, dtype=torch.float32)
    for layout in ("page_first", "page_first_direct", "page_head"):
        device = build_device_pool(geom, 64)
        host = build_host_pool(geom, tokens=64, layout=layout, device_pool=device)
        assert host.pin_memory is False
        g = torch.Generator().manual_seed(0)
        for buf in (*device.k_buffer, *device.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=g))
        dev = torch.arange(8, 16)      # two pages of the device pool
        hst = torch.arange(20, 28)     # two pages of the host pool
        host.backup_from_device_all_layer(device, hst, dev, "kernel")
        # where the backend reads a page: SGLang's own page metadata
        ptrs, sizes = host.get_page_buffer_meta(hst)
        for page in range(2):
            tokens = dev[page * 4:(page + 1) * 4]
            for part, bufs in enumerate((device.k_buffer, device.v_buffer)):
                want = torch.stack([b[tokens] for b in bufs])  # (layer, token, head, dim)
                if layout == "page_first":
                    want = want.permute(1, 0, 2, 3)            # (token, layer, head, dim)
                elif layout == "page_head":
                    want = want.permute(2, 1, 0, 3)            # (head, token, layer, dim)
                ptr, size = ptrs[2 * page + part], sizes[2 * page + part]
                got = torch.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=torch.float32)
                assert torch.equal(got, want.reshape(-1)), (layout, page, part)
        # and back, into other device slots
        back = torch.arange(40, 48)
        for layer in range(geom.layer_num):
            host.load_to_device_per_layer(device, hst, back, layer, "kernel")
        for bufs in (device.k_buffer, device.v_buffer):
            for b in bufs:
                assert torch.equal(b[back], b[dev]), layout
    print("ok")
    """
)


def test_host_pool_transfers_put_bytes_where_the_page_metadata_says():
    """In a subprocess (the stand-ins patch SGLang's classes): device -> host
    -> device through the stand-in copies of a real SGLang 0.5.23 host pool,
    checked against the pool's own get_page_buffer_meta, for each layout."""
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _HOST_POOL_ROUND_TRIP],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
