"""The local store on a disk: bigger than RAM, kept across stops, idle exits,
kill -9, reboots; never a torn or foreign object after a power loss; a full
disk is a refused put. Store directories on the disk the tests run on
(``$SGLANG_SIMM_DISK_TEST_DIR``, else the temp directory)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from checked_objects import Objects
from polling import until
from raw_peer import StoreProc, wait_status
from sglang_simm.local_store._paths import StorePaths
from sglang_simm.local_store._segments import medium_of
from sglang_simm.local_store._table import ENTRY, HEADER_BYTES
from sglang_simm.simm_rules import DS_KEY_NOT_FOUND, OK, OUT_OF_MEMORY

pytestmark = pytest.mark.host

SIZE = 256 << 10


@pytest.fixture(params=["page-aligned", "unaligned"])
def disk(request):
    """A store directory on a disk, and whether this test's client buffers
    are page-aligned (I/O past the page cache) or not (through it)."""
    base = os.environ.get("SGLANG_SIMM_DISK_TEST_DIR") or tempfile.gettempdir()
    if medium_of(base) != "disk":
        pytest.skip(f"{base} is no disk")
    root = tempfile.mkdtemp(prefix="sglang-simm-disk-", dir=base)
    os.chmod(root, 0o700)
    made: list = []
    yield root, made, request.param == "page-aligned"
    for thing in made:
        thing.close() if isinstance(thing, Objects) else thing.stop()
    shutil.rmtree(root, ignore_errors=True)


def start(disk, **kw) -> StoreProc:
    root, made, _ = disk
    made.append(StoreProc(root, "s", **kw))
    return made[-1]


def client(disk) -> Objects:
    root, made, aligned = disk
    made.append(Objects(root, "s", SIZE, aligned=aligned))
    return made[-1]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def drop_page_cache(paths: StorePaths) -> None:
    """What a reboot does to the page cache: the files' pages written out and dropped."""
    for path in paths.data_files():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_store_on_a_disk_says_so_and_keeps_its_objects_through_stop_idle_exit_and_kill_9(disk):
    proc = start(disk, capacity=64 << 20, idle_exit=1.0)
    status = proc.status()
    assert status["medium"] == "disk" and status["fs_total_bytes"] > 0
    me = client(disk)
    assert me.put(keys("k", 20)) == [OK] * 20
    me.close()  # no client: the idle exit keeps the objects on a disk
    until(lambda: not proc.alive(), what="the idle store to exit")
    assert proc.paths.segments() and "its objects kept" in proc.log_tail()
    again = start(disk, capacity=64 << 20)
    me = client(disk)
    got, wrong = me.read(keys("k", 20))
    assert got == [SIZE] * 20 and wrong == []
    again.kill9()
    third = start(disk, capacity=64 << 20)
    got, wrong = me.read(keys("k", 20))
    assert got == [SIZE] * 20 and wrong == [] and third.status()["checksum_failures"] == 0


def test_a_reboot_keeps_every_object(disk):
    """Every process gone, the page cache dropped, the files reopened: each
    object comes back whole, checked on its first read."""
    proc = start(disk, capacity=64 << 20)
    me = client(disk)
    assert me.put(keys("k", 40)) == [OK] * 40
    me.close()
    proc.kill9()
    drop_page_cache(proc.paths)
    after = start(disk, capacity=64 << 20)
    me = client(disk)
    got, wrong = me.read(keys("k", 40))
    assert got == [SIZE] * 40 and wrong == []
    status = after.status()
    assert status["recovered"] == 40 and status["checksum_failures"] == 0 and not status["earlier_held"]


def _entries(paths: StorePaths) -> np.memmap:
    slots = (os.path.getsize(paths.index) - HEADER_BYTES) // ENTRY.itemsize
    return np.memmap(paths.index, dtype=ENTRY, mode="r+", offset=HEADER_BYTES, shape=(slots,))


def _slot(entries, key: str) -> int:
    return int(np.flatnonzero((entries["key"] == key.encode()) & (entries["state"] != 0))[0])


@pytest.mark.parametrize("stop", ["clean", "kill -9"])
def test_damaged_bytes_and_a_foreign_entry_read_as_misses_and_the_rest_is_served(disk, stop):
    """Bytes changed in 10 objects' data on the disk, and one index entry
    pointed at another object's bytes: those 11 miss, with counts, 0 wrong
    bytes, the rest served."""
    proc = start(disk, capacity=64 << 20)
    me = client(disk)
    assert me.put(keys("k", 30)) == [OK] * 30
    proc.stop() if stop == "clean" else proc.kill9()
    e = _entries(proc.paths)
    (path,) = proc.paths.segments().values()
    with open(path, "r+b") as f:
        for key in keys("k", 10):
            f.seek(int(e["offset"][_slot(e, key)]) + 4096)
            f.write(os.urandom(16))
    e["offset"][_slot(e, "k10")] = e["offset"][_slot(e, "k29")]
    e["state"][_slot(e, "k29")] = 0  # k10 now names k29's bytes
    e.flush()
    drop_page_cache(proc.paths)
    after = start(disk, capacity=64 << 20)
    got, wrong = me.read(keys("k", 29))
    assert wrong == [] and got == [DS_KEY_NOT_FOUND] * 11 + [SIZE] * 18
    status = after.status()
    assert status["checksum_failures"] == 11 and status["objects"] == 18


def test_a_power_loss_serves_no_torn_or_foreign_object(disk):
    """A power loss as the disk may leave it: writes cut short (data never
    written behind a committed entry), an entry torn across its fields;
    every such object is a miss, every other one whole."""
    proc = start(disk, capacity=64 << 20)
    me = client(disk)
    assert me.put(keys("k", 30)) == [OK] * 30
    proc.kill9()
    e = _entries(proc.paths)
    (path,) = proc.paths.segments().values()
    fd = os.open(path, os.O_RDWR)
    try:
        for key in keys("k", 5):  # cut short: the object's tail never reached the disk
            offset = int(e["offset"][_slot(e, key)])
            os.pwrite(fd, bytes(SIZE // 2), offset + SIZE // 2)
    finally:
        os.close(fd)
    torn = _slot(e, "k5")
    e["size"][torn] = SIZE // 2  # an entry whose size is of another write
    e["crc"][_slot(e, "k6")] ^= 1  # one whose checksum is
    e.flush()
    drop_page_cache(proc.paths)
    after = start(disk, capacity=64 << 20)
    got, wrong = me.read(keys("k", 30))
    assert wrong == []
    assert [k for k, n in zip(keys("k", 30), got) if n != SIZE] == keys("k", 7)
    assert after.status()["checksum_failures"] == 7


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB ext4 filesystem of the test's own (needs root and a loop device)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("a small disk needs root and mkfs.ext4")
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir(mode=0o700)
    subprocess.run(["truncate", "-s", "48M", str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if made.returncode or done.returncode:
        pytest.skip(f"cannot mount a small disk here: {made.stderr.strip() or done.stderr.strip()}")
    os.chmod(mount, 0o700)
    procs: list = []
    try:
        yield str(mount), procs
    finally:
        for p in procs:
            p.close() if isinstance(p, Objects) else p.stop()
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned", "unaligned"])
def test_a_full_disk_is_a_refused_put_never_a_crash(small_disk, aligned):
    root, made = small_disk
    proc = StoreProc(root, "s", capacity=256 << 20, extra=("--force",))
    made.append(proc)
    me = Objects(root, "s", 1 << 20, aligned=aligned)
    made.append(me)
    codes = [me.put([f"k{i}"])[0] for i in range(80)]
    assert OUT_OF_MEMORY in codes and codes[0] == OK, codes  # 48 MiB cannot hold 80
    assert proc.alive()
    first_full = codes.index(OUT_OF_MEMORY)
    got, wrong = me.read([f"k{i}" for i in range(first_full)])
    assert wrong == []
    status = wait_status(proc, lambda s: s["memory_limited"], "the store to lower its capacity to the disk")
    assert status["capacity_bytes"] < 48 << 20
    # within what the disk holds, evicting; the blocks an eviction frees come
    # back to ext4 when its journal commits (within 5 s), so a put may be
    # refused until then
    until(lambda: me.put(["after"]) == [OK], what="a put within what the disk holds", timeout=15)


def test_a_client_of_a_disk_store_maps_only_the_client_table(disk):
    """The page cache is the system's: a client reads and writes through the
    descriptor, so its memory does not grow with the store."""
    proc = start(disk, capacity=64 << 20)
    me = client(disk)
    assert me.put(keys("k", 40)) == [OK] * 40
    me.read(keys("k", 40))
    (path,) = proc.paths.segments().values()
    with open("/proc/self/maps") as f:
        spans = [line.split()[0] for line in f if path in line]
    sizes = [int(hi, 16) - int(lo, 16) for lo, hi in (s.split("-") for s in spans)]
    assert spans and max(sizes) <= 1 << 20  # the header and the client table, not the objects


def test_a_filesystem_that_refuses_direct_io_is_read_and_written_through_the_page_cache(disk, monkeypatch):
    """Some filesystems open with O_DIRECT and then refuse its I/O (EINVAL):
    every object still goes in and comes back whole."""
    refused = []

    def refusing(call):
        def io(fd, views, off):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return call(fd, views, off)
        return io

    monkeypatch.setattr(os, "pwritev", refusing(os.pwritev))
    monkeypatch.setattr(os, "preadv", refusing(os.preadv))
    proc = start(disk, capacity=64 << 20)
    me = client(disk)
    assert me.put(keys("k", 20)) == [OK] * 20
    drop_page_cache(proc.paths)
    got, wrong = me.read(keys("k", 20))
    assert got == [SIZE] * 20 and wrong == []
    assert bool(refused) == disk[2]  # page-aligned buffers tried O_DIRECT first
