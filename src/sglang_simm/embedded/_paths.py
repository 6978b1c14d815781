"""Where a host store lives, and who may open it.

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
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
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
                f"host store {self.name!r} in {self.root}: its socket path {self.socket} is {length} bytes, and a "
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


def read_pid(paths: StorePaths) -> int | None:
    try:
        with open(paths.pid) as f:
            text = f.read().strip()
    except (FileNotFoundError, PermissionError):
        return None
    return int(text) if text.isdigit() else None
