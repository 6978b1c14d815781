"""Where a local store lives, and who may open it.

One directory per user (``/dev/shm/sglang-simm-<uid>`` by default, or
``$SGLANG_SIMM_STORE_DIR``), mode 0700; in it, per store name: ``NAME.sock``
(the store process's socket, 0600), ``NAME.lock`` (held by the store process
while it lives: one process per name), ``NAME.pid``, ``NAME.log``, the
shared arena ``NAME.<generation>.arena``, its index table ``NAME.index`` and
the settings the store was started with, ``NAME.json`` (all 0600). Arena,
index and settings outlive a store process that dies, so the next one takes
its objects over. Only the owning user can
reach any of it; anything in the way that belongs to someone else, or that
others could open, is refused with a message saying what to do.

Also what the files say of the process behind them (``read_pid``,
``pid_alive``, ``lock_held``), and ``private_store_dir``: a directory of
one run's own, removed with its stores at the end.
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
#: Linux's sun_path holds 108 bytes with its terminating NUL; a longer socket
#: path fails only inside the store process, where nobody reads the error.
MAX_SOCKET_PATH = 107


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


def _owned_privately(st: os.stat_result) -> str | None:
    """Why ``st`` is not this user's alone, or None."""
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"its mode {stat.filemode(st.st_mode)} lets other users in"
    return None


def ensure_dir(path: str, *, create: bool = True) -> str:
    """The store directory, made 0700 if absent; StoreAccessError if it is a
    symlink, not a directory, someone else's, or open to others."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=False)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreAccessError(
            f"the store directory {path} is not a plain directory; remove it or set "
            f"{STORE_DIR_ENV} to a directory of your own"
        )
    why = _owned_privately(st)
    if why:
        raise StoreAccessError(
            f"the store directory {path} is in the way: {why}. Another user's store may live there: "
            f"set {STORE_DIR_ENV} to a directory of your own (or, if it is yours, chmod 700 it)"
        )
    return path


def check_file(path: str, fd: int | None = None) -> None:
    """StoreAccessError unless ``path`` (or the open ``fd``) is this user's
    alone; FileNotFoundError passes through."""
    st = os.fstat(fd) if fd is not None else os.lstat(path)
    if fd is None and stat.S_ISLNK(st.st_mode):
        raise StoreAccessError(f"{path} is a symlink; the store opens only its own files")
    why = _owned_privately(st)
    if why:
        raise StoreAccessError(f"{path} is not this user's alone: {why}; remove it, or stop the store that made it")


def open_private(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a store file, never through a symlink (``O_NOFOLLOW``:
    a link planted in the directory would make the store write, truncate
    or append to its target), checked to be this user's alone; the fd.
    StoreAccessError, saying so, for a symlink; FileNotFoundError passes
    through."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreAccessError(
                f"{path} is a symlink; the store opens only its own files: remove it") from None
        raise
    try:
        check_file(path, fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreAccessError(f"{path} is not a plain file; remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd


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
                f"directory ({STORE_DIR_ENV} or --dir)"
            )

    @property
    def socket(self) -> str:
        return os.path.join(self.root, f"{self.name}.sock")

    @property
    def lock(self) -> str:
        return os.path.join(self.root, f"{self.name}.lock")

    @property
    def pid(self) -> str:
        return os.path.join(self.root, f"{self.name}.pid")

    @property
    def log(self) -> str:
        return os.path.join(self.root, f"{self.name}.log")

    @property
    def index(self) -> str:
        return os.path.join(self.root, f"{self.name}.index")

    @property
    def settings(self) -> str:
        return os.path.join(self.root, f"{self.name}.json")

    def arena(self, generation: str) -> str:
        return os.path.join(self.root, f"{self.name}.{generation}.arena")

    def arenas(self) -> list[str]:
        """Arena files of this name, any generation (stale ones included)."""
        prefix, suffix = f"{self.name}.", ".arena"
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [
            os.path.join(self.root, e)
            for e in entries
            if e.startswith(prefix) and e.endswith(suffix) and "." not in e[len(prefix) : -len(suffix)]
        ]


def store_names(root: str) -> list[str]:
    """Names with a socket, settings or an index in ``root`` (live or
    dead), sorted."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    names = set()
    for e in entries:
        for suffix in (".sock", ".json", ".index"):
            if e.endswith(suffix) and NAME_RE.match(e[: -len(suffix)]):
                names.add(e[: -len(suffix)])
    return sorted(names)


def held_bytes(paths: StorePaths) -> int:
    """Memory the store's files hold (arena, index), live or dead."""
    total = 0
    for path in [*paths.arenas(), paths.index]:
        try:
            total += os.lstat(path).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def lock_held(paths: StorePaths) -> bool:
    """True while a store process holds the name's lock (running, starting,
    stopping or stalled): then nobody may start another."""
    return flock_held(paths.lock)


def flock_held(path: str) -> bool:
    """True while another open file of ``path`` holds a ``flock`` on it
    (False when there is no such file, or it is a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def pid_alive(pid: int | None) -> bool:
    """True while process ``pid`` runs (a zombie waiting to be reaped does not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_pid(paths: StorePaths) -> int | None:
    try:
        fd = os.open(paths.pid, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            text = f.read(64).strip()
    except OSError:  # absent, someone else's, or a symlink
        return None
    return int(text) if text.isdigit() else None


#: How long ``private_store_dir`` waits for its stores to stop after each
#: signal (SIGTERM, then SIGKILL).
STOP_WAIT_S = 5.0


@contextlib.contextmanager
def private_store_dir(prefix: str, parent: str | None = None) -> Iterator[str]:
    """A store directory of one run's own (a benchmark's, a test session's),
    made private under the directory stores would use (``store_dir``'s
    parent: ``$SGLANG_SIMM_STORE_DIR``'s when set, else /dev/shm) and
    exported as ``$SGLANG_SIMM_STORE_DIR`` meanwhile, so store processes and
    SGLang servers started in it use it too; ``parent``, when given (a
    config's ``local_store_dir``), is where it is made instead, and the
    caller points its config at it. At the end every store process
    with a pid file in it is stopped (SIGTERM, then SIGKILL) and the
    directory removed.

    Why: a store's stop keeps its lock and log files by design (the log is
    what an operator reads after a fault, the lock is what one process per
    name rests on), so tools that start stores under fresh names would
    otherwise leave a pair behind in the operator's directory on every run.
    Removing a lock file is safe only where no other process can start a
    store of that name: a directory nobody else knows of."""
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
    """Stop every store process with a pid file in ``root`` by its pid:
    SIGTERM, then SIGKILL for those still running after ``wait_s``. The
    pids signalled. A pid is signalled only while its name's lock is held,
    so a pid file left by a store that died never names a process that
    reused its pid."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    pids = []
    for entry in entries:
        if entry.endswith(".pid") and NAME_RE.match(entry[: -len(".pid")]):
            paths = StorePaths(root, entry[: -len(".pid")])
            pid = read_pid(paths)
            if pid and pid != os.getpid() and pid_alive(pid) and lock_held(paths):
                pids.append(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
    return pids
