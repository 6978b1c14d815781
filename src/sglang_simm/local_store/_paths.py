"""Where a local store lives, who may open it, and who is still alive.

One directory per user (``/dev/shm/sglang-simm-<uid>`` by default, or
``$SGLANG_SIMM_STORE_DIR``), mode 0700. Per store name: ``NAME.sock``,
``NAME.lock`` (held by the store process while it lives: one per name),
``NAME.pid``, ``NAME.log``, ``NAME.json`` (its settings), ``NAME.index``
(its objects) and one segment per store process, ``NAME.<gen>.seg``. Every
file is 0600, opened without following symlinks and checked to be this
user's alone; anything in the way that is someone else's is refused with a
message that says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

STORE_DIR_ENV = "SGLANG_SIMM_STORE_DIR"
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")
NAME_RULE = "1-64 of A-Z a-z 0-9 . _ -, starting with a letter, digit or '_'"
#: Linux's sun_path holds 108 bytes with its NUL; a longer socket path would
#: fail only inside the store process, where nobody reads the error.
MAX_SOCKET_PATH = 107
SEGMENT_RE = re.compile(r"[0-9a-f]{16}\Z")


class StoreAccessError(PermissionError):
    """The store's directory or files are not this user's alone."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"store name {name!r} is not valid: use {NAME_RULE}")
    return name


def default_dir() -> str:
    """``/dev/shm/sglang-simm-<uid>`` (shared memory), else under the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"sglang-simm-{os.geteuid()}")


def store_dir(explicit: str | None = None) -> str:
    return os.path.abspath(explicit or os.environ.get(STORE_DIR_ENV) or default_dir())


def _not_private(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"its mode {stat.filemode(st.st_mode)} lets other users in"
    return None


def ensure_dir(path: str, *, create: bool = True) -> str:
    """The store directory, made 0700 if absent; StoreAccessError if it is a
    symlink, not a directory, someone else's, or open to others."""
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreAccessError(f"the store directory {path} is not a plain directory; remove it or set "
                               f"{STORE_DIR_ENV} to a directory of your own")
    why = _not_private(st)
    if why:
        raise StoreAccessError(f"the store directory {path} is in the way: {why}. Another user's store may live "
                               f"there: set {STORE_DIR_ENV} to a directory of your own (or, if it is yours, "
                               "chmod 700 it)")
    return path


def check_file(path: str, fd: int | None = None) -> None:
    """StoreAccessError unless ``path`` (or the open ``fd``) is this user's alone."""
    st = os.fstat(fd) if fd is not None else os.lstat(path)
    if fd is None and stat.S_ISLNK(st.st_mode):
        raise StoreAccessError(f"{path} is a symlink; the store opens only its own files")
    why = _not_private(st)
    if why:
        raise StoreAccessError(f"{path} is not this user's alone: {why}; remove it, or stop the store that made it")


def open_private(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a store file, never through a symlink (a link planted in
    the directory would make the store write to its target), checked to be
    a plain file of this user's alone."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreAccessError(f"{path} is a symlink; the store opens only its own files: remove it") from None
        raise
    try:
        check_file(path, fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreAccessError(f"{path} is not a plain file; remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True)
class StorePaths:
    """The files of store ``name`` in directory ``root``."""

    root: str
    name: str

    def __post_init__(self) -> None:
        check_name(self.name)
        length = len(os.fsencode(self.socket))
        if length > MAX_SOCKET_PATH:
            raise ValueError(
                f"local store {self.name!r} in {self.root}: its socket path {self.socket} is {length} bytes, and a "
                f"Unix socket path holds at most {MAX_SOCKET_PATH}; use a shorter store name, or a shorter "
                f"directory ({STORE_DIR_ENV} or --dir)")

    def _file(self, suffix: str) -> str:
        return os.path.join(self.root, f"{self.name}.{suffix}")

    socket = property(lambda self: self._file("sock"))
    lock = property(lambda self: self._file("lock"))
    pid = property(lambda self: self._file("pid"))
    log = property(lambda self: self._file("log"))
    index = property(lambda self: self._file("index"))
    settings = property(lambda self: self._file("json"))

    def segment(self, gen: str) -> str:
        return self._file(f"{gen}.seg")

    def segments(self) -> dict[str, str]:
        """Segment files of this name: generation -> path."""
        prefix = f"{self.name}."
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return {}
        gens = (e[len(prefix):-4] for e in entries if e.startswith(prefix) and e.endswith(".seg"))
        return {g: self.segment(g) for g in gens if SEGMENT_RE.match(g)}

    def data_files(self) -> list[str]:
        """What holds objects: the segments and the index."""
        return [*self.segments().values(), self.index]


def store_names(root: str) -> list[str]:
    """Names with a socket, settings or an index in ``root`` (live or dead)."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    names = set()
    for e in entries:
        stem, _, suffix = e.rpartition(".")
        if suffix in ("sock", "json", "index") and NAME_RE.match(stem):
            names.add(stem)
    return sorted(names)


def files_bytes(paths: StorePaths) -> int:
    """Memory or disk the store's files hold, its process alive or dead."""
    total = 0
    for path in paths.data_files():
        with contextlib.suppress(FileNotFoundError):
            total += os.lstat(path).st_blocks * 512
    return total


def lock_held(paths: StorePaths) -> bool:
    """True while a store process holds the name's lock (running, starting,
    stopping or stalled): then nobody may start another."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


# -- processes: (pid, start time, boot) names one process, once ---------------------------


def boot_id() -> str:
    """This boot's id: a pid and start time from another boot name nobody."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        return ""


def _stat(pid: int) -> tuple[bytes, int] | None:
    """Process ``pid``'s state letter and start time (``/proc/PID/stat``
    field 22), or None when there is no such process. Any other failure
    (no descriptor left) raises: it says nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        fields = stat_line[stat_line.rindex(b")") + 2:].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def proc_start(pid: int) -> int | None:
    got = _stat(pid) if pid > 0 else None
    return got[1] if got is not None else None


def proc_alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a
    zombie maps nothing: gone; a reused pid is another process). When
    /proc cannot be read, alive: memory is never given back on a guess."""
    try:
        got = _stat(pid) if pid > 0 else None
    except OSError:
        return True
    return got is not None and got[1] == start and got[0] != b"Z"


def pid_alive(pid: int | None) -> bool:
    """True while process ``pid`` runs (a zombie does not)."""
    if not pid:
        return False
    start = proc_start(pid)
    return start is not None and proc_alive(pid, start)


def read_pid(paths: StorePaths) -> int | None:
    try:
        fd = os.open(paths.pid, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


#: How long ``stop_store_processes`` waits after each signal.
STOP_WAIT_S = 5.0


@contextlib.contextmanager
def private_store_dir(prefix: str, parent: str | None = None) -> Iterator[str]:
    """A store directory of one run's own (a benchmark's, a test session's,
    doctor's), made under ``parent`` (default: where stores would live) and
    exported as ``$SGLANG_SIMM_STORE_DIR`` meanwhile, so store processes and
    servers started in it use it too. At the end its store processes are
    stopped by their pid and the directory removed: a store's stop keeps its
    lock and log by design, and only a directory nobody else knows of may
    lose them."""
    explicit = os.environ.get(STORE_DIR_ENV)
    if parent:
        base = os.path.abspath(parent)
        os.makedirs(base, mode=0o700, exist_ok=True)
    else:
        base = explicit if explicit and os.path.isdir(explicit) else os.path.dirname(default_dir())
    root = tempfile.mkdtemp(prefix=prefix, dir=base)
    os.chmod(root, 0o700)
    os.environ[STORE_DIR_ENV] = root
    try:
        yield root
    finally:
        if explicit is None:
            os.environ.pop(STORE_DIR_ENV, None)
        else:
            os.environ[STORE_DIR_ENV] = explicit
        stop_store_processes(root)
        shutil.rmtree(root, ignore_errors=True)


def stop_store_processes(root: str, wait_s: float = STOP_WAIT_S) -> list[int]:
    """Stop every store process with a pid file in ``root`` (SIGTERM, then
    SIGKILL); the pids signalled. A pid is signalled only while its name's
    lock is held, so a stale pid file never names a process that reused it."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    pids = []
    for entry in entries:
        if entry.endswith(".pid") and NAME_RE.match(entry[:-4]):
            paths = StorePaths(root, entry[:-4])
            pid = read_pid(paths)
            if pid and pid != os.getpid() and pid_alive(pid) and lock_held(paths):
                pids.append(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [p for p in pids if pid_alive(p)]:  # a pid gone since may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
    return pids
