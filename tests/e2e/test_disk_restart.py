"""A real CPU server on a local store on a disk, restarted: the server and
its store stopped (cleanly, then in a second run by kill -9), the page cache
of the store's files dropped, both started again. Every prompt's whole
prefix comes back from L3 and every output is the same, token and logprob.
"""

from __future__ import annotations

import os
import signal

import pytest
from e2e_util import DEVICE_TOKENS, PAGE, matchable_tokens, prompt

from sglang_simm.local_store._paths import stop_store_processes
from sglang_simm.local_store.admin import STORE_DIR_ENV, StorePaths, medium_of, open_running, read_pid
from sglang_simm_dev.sglang_server import ServerConfig, SGLangServer

pytestmark = pytest.mark.e2e

LONG = 512
SEEDS = (4101, 4102, 4103)
#: a generous request time limit: a cold read of a page from the disk is not a fault
REQUEST_TIMEOUT_MS = 10_000


def drop_page_cache(root: str) -> None:
    """The store's files out of the page cache, as after a reboot (this
    process may not write /proc/sys/vm/drop_caches)."""
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.mark.parametrize("how", ["stop", "kill-9"])
def test_a_server_on_a_disk_store_restarted_gets_every_prefix_back_from_l3(tiny_llama, tmp_path, how):
    disk = str(tmp_path / "store")
    os.makedirs(disk, mode=0o700)
    if medium_of(disk) != "disk":
        pytest.skip(f"{disk} is not on a disk filesystem")
    name = f"e2e-disk-{how}"
    config = ServerConfig(model_path=tiny_llama, route="simm", page_size=PAGE, max_total_tokens=DEVICE_TOKENS,
                          sleep_on_idle=True, env={STORE_DIR_ENV: disk},
                          extra_config={"manager_address": f"local://{name}", "local_store_dir": disk,
                                        "request_timeout_ms": REQUEST_TIMEOUT_MS})
    paths = StorePaths(disk, name)
    try:
        restart(config, paths, tmp_path, how)
    finally:
        stop_store_processes(disk)


def restart(config: ServerConfig, paths: StorePaths, tmp_path, how: str) -> None:
    disk, name = paths.root, paths.name
    first = SGLangServer(config, tmp_path / "first", name=f"disk-{how}-first").start()
    try:
        before = first.l3_pages_stored()
        refs = {seed: first.generate(prompt(seed, LONG)) for seed in SEEDS}
        first.wait_l3_stored(before + len(SEEDS) * (LONG // PAGE))
        store_pid = read_pid(paths)
        if how == "stop":
            first.stop()
            handle = open_running(disk, name)
            assert handle.stop(), "the store did not stop"
        else:
            first.crash()
            os.kill(store_pid, signal.SIGKILL)
    finally:
        first.stop()
    assert paths.segments(), "the store's objects were not kept"
    drop_page_cache(disk)

    with SGLangServer(config, tmp_path / "second", name=f"disk-{how}-second") as second:
        for seed in SEEDS:
            again = second.generate(prompt(seed, LONG))
            assert again.storage_tokens == matchable_tokens(LONG, PAGE), (
                f"{how}: prompt {seed} got {again.cached_details} from the caches; log {second.log_path}")
            assert again.output_ids == refs[seed].output_ids and again.logprobs == refs[seed].logprobs
        assert read_pid(paths) != store_pid  # served by the next store process, from the disk
