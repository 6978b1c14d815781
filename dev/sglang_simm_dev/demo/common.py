"""What both demos share: results, errors, page keys and patterns, progress, the outer run.

Results (``Phase``, ``DemoResult``) are what the table and the JSON are built
from; ``DemoFailure`` and ``DemoSetupError`` are the two ways a run ends
badly (exit 1 and 2); pages are keyed by SGLang's own page hash and filled
with a pattern derived from their key, so a wrong byte shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

#: The controller's batch size (SGLang's ``STORAGE_BATCH_SIZE``), when the
#: installed SGLang does not export it.
FALLBACK_BATCH_SIZE = 128
#: Poison written over the host pool before every restore: a page that is
#: not really loaded cannot pass the byte comparison.
POISON_BYTE = 0xA5
#: A vocabulary size for the synthetic prompts (Llama 3's).
VOCAB_SIZE = 128_256

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SETUP = 2


class DemoFailure(Exception):
    """A check failed: a page is missing, a lookup is wrong or a byte differs."""


class DemoSetupError(Exception):
    """The demo cannot run with these options on this machine."""


# ---------------------------------------------------------------- utilities


def quiet_imports() -> contextlib.AbstractContextManager[Any]:
    """SGLang warns at import about GPU-only quantization methods; on a CPU
    that is expected noise."""
    cm = warnings.catch_warnings()

    class _Quiet:
        def __enter__(self) -> None:
            cm.__enter__()
            warnings.simplefilter("ignore")

        def __exit__(self, *exc: Any) -> None:
            cm.__exit__(*exc)

    return _Quiet()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def peak_rss_bytes() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def storage_batch_size() -> int:
    try:
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        return int(STORAGE_BATCH_SIZE)
    except Exception:
        return FALLBACK_BATCH_SIZE


# ------------------------------------------------------------- page hashes


def python_page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's page hash chain in pure Python: per whole page, SHA-256 over
    the previous page's digest (if any) and the page's token ids as
    little-endian uint32 (``hash_binding.cpp``, token ids below 2**32)."""
    import hashlib
    from array import array

    prior = bytes.fromhex(prior_hash) if prior_hash else None
    out: list[str] = []
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        page = array("I", token_ids[start:start + page_size])
        if sys.byteorder != "little":
            page.byteswap()
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(page.tobytes())
        prior = h.digest()
        out.append(h.hexdigest())
    return out


def sglang_hash_function() -> tuple[Callable[..., Any] | None, str]:
    """SGLang's own ``get_storage_hash_str`` if it imports and its native
    extension loads; else None and why."""
    try:
        with quiet_imports():
            from sglang.srt.mem_cache.utils import get_storage_hash_str
        get_storage_hash_str([1, 2], None, page_size=2)
        return get_storage_hash_str, "sglang.srt.mem_cache.utils.get_storage_hash_str"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


class PageHasher:
    """Page keys the way SGLang computes them (its function when it works)."""

    def __init__(self) -> None:
        self.fn, detail = sglang_hash_function()
        if self.fn is not None:
            self.source = detail
            self.fallback_reason = None
        else:
            self.source = "python re-implementation of SGLang's page hash"
            self.fallback_reason = detail

    def __call__(self, token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
        if self.fn is not None:
            return list(self.fn(list(token_ids), prior_hash, page_size=page_size))
        return python_page_hashes(token_ids, page_size, prior_hash)


# ---------------------------------------------------------------- patterns


class PagePattern:
    """A deterministic byte pattern per page, tied to the page's key.

    One random block the size of a page (fixed seed), XORed word by word
    with 64 bits of the page's key: every page differs from every other,
    and every word of a page from its neighbours, so a lost, swapped,
    shifted or partly written page cannot compare equal.
    """

    def __init__(self, page_bytes: int, seed: int = 0x51AA):
        import torch

        self.page_bytes = page_bytes
        words = (page_bytes + 7) // 8
        gen = torch.Generator().manual_seed(seed)
        self._base = torch.randint(0, 256, (words * 8,), dtype=torch.uint8, generator=gen).view(torch.int64)

    @staticmethod
    def key_seed(key: str) -> int:
        value = int(key[:16], 16) if len(key) >= 16 else hash(key) & (2**64 - 1)
        return value - 2**64 if value >= 2**63 else value

    def _words(self, key: str) -> Any:
        return self._base ^ self.key_seed(key)

    def expected(self, key: str) -> Any:
        """The page's bytes (uint8)."""
        import torch

        return self._words(key).view(torch.uint8)[: self.page_bytes]

    def fill(self, host: Any, slot: int, key: str) -> None:
        import torch

        words = self._words(key)
        data = words if self.page_bytes % 8 == 0 else words.view(torch.uint8)[: self.page_bytes]
        host.set_from_flat_data_page(slot, data.view(host.dtype))

    def check(self, host: Any, slot: int, key: str) -> int | None:
        """None when the page at ``slot`` holds exactly ``key``'s pattern;
        else the offset of the first differing byte."""
        import torch

        got = host.get_data_page(slot, flat=True).reshape(-1).view(torch.uint8)
        if got.numel() != self.page_bytes:
            return min(got.numel(), self.page_bytes)
        if self.page_bytes % 8 == 0:
            # word by word: the same bytes, an eighth of the comparisons
            if torch.equal(got.view(torch.int64) ^ self.key_seed(key), self._base):
                return None
        want = self.expected(key)
        if torch.equal(got, want):
            return None
        return int((got != want).nonzero()[0].item())


def wipe(host: Any) -> None:
    import torch

    buffers = [getattr(host, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    for buf in buffers:
        if isinstance(buf, torch.Tensor):
            buf.view(-1).view(torch.uint8).fill_(POISON_BYTE)


# ---------------------------------------------------------------- progress


class Progress:
    """rich progress bars on a terminal; nothing otherwise."""

    def __init__(self, console: Any):
        self._progress = None
        if console is not None and getattr(console, "is_terminal", False):
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._progress = Progress(
                    SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
                )
            except ImportError:
                self._progress = None

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """Yields ``update(completed)``."""
        if self._progress is None:
            yield lambda _completed: None
            return
        progress = self._progress
        progress.start()
        tid = progress.add_task(description, total=max(total, 1))
        try:
            yield lambda completed: progress.update(tid, completed=completed)
        finally:
            progress.remove_task(tid)
            progress.stop()


# ------------------------------------------------------------------ results


@dataclass
class Phase:
    name: str
    request: str
    kind: str  # "write" or "read"
    pages: int  # pages offered (write) or looked up (read)
    hits: int | None = None  # pages the lookup found (read)
    pages_moved: int = 0  # pages stored (write) or loaded (read)
    page_bytes: int = 0
    seconds: float = 0.0  # the storage work: enqueue to last acknowledgement
    lookup_seconds: float | None = None
    verified_pages: int = 0
    relocated_pages: int | None = None

    @property
    def bytes(self) -> int:
        return self.pages_moved * self.page_bytes

    @property
    def hit_rate(self) -> float | None:
        if self.kind != "read" or self.hits is None or not self.pages:
            return None
        return self.hits / self.pages

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(bytes=self.bytes, hit_rate=self.hit_rate, gbps=self.gbps)
        return d


@dataclass
class DemoResult:
    info: dict[str, Any] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    verified_pages: int = 0
    verified_bytes: int = 0
    expected_verified_bytes: int = 0
    ok: bool = False
    error: str | None = None
    total_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.info,
            "phases": [p.as_dict() for p in self.phases],
            "verified_pages": self.verified_pages,
            "verified_bytes": self.verified_bytes,
            "expected_verified_bytes": self.expected_verified_bytes,
            "ok": self.ok,
            "error": self.error,
            "total_seconds": self.total_seconds,
            "peak_rss_bytes": peak_rss_bytes(),
        }


# ------------------------------------------------------------------ options


@dataclass
class DemoOptions:
    model: str = "llama3-8b"
    pages: int | None = None
    page_size: int | None = None
    layout: str = "page_first"
    direct: bool = False
    json_path: str | None = None
    seed: int | None = None
    timeout_s: float | None = None

    @classmethod
    def from_args(cls, args: Any) -> DemoOptions:
        return cls(
            model=getattr(args, "model", None) or "llama3-8b",
            pages=getattr(args, "pages", None),
            page_size=getattr(args, "page_size", None),
            layout=getattr(args, "layout", None) or "page_first",
            direct=bool(getattr(args, "direct", False)),
            json_path=getattr(args, "json", None),
            seed=getattr(args, "seed", None),
            timeout_s=getattr(args, "timeout", None),
        )


def resolve_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The extra config with ``manager_address`` defaulting to a local store of
    the demo's own (``local://demo-<pid>``, when no source sets it: never the
    ``local`` store a server on this host may be using), and the resolved
    SiMM config."""
    from sglang_simm import config as cfg

    extra = dict(extra)
    if names_own_store(extra):
        extra["manager_address"] = f"local://demo-{os.getpid()}"
    return extra, cfg.load_config(extra)


def names_own_store(extra: dict[str, Any]) -> bool:
    """True when no config source names a ``manager_address``: the demo then
    runs on a local store of its own (``resolve_extra``)."""
    from sglang_simm import config as cfg

    if "manager_address" in extra:
        return False
    for _name, source in cfg.SOURCES:
        try:
            if "manager_address" in source(extra, os.environ):
                return False
        except Exception:
            return False  # a broken source: let load_config report it
    return True


@contextlib.contextmanager
def own_local_store(config: Any) -> Iterator[None]:
    """Drop the local store named by ``config`` at the end, its memory
    with it, when the run is what created it."""
    from sglang_simm.local_store import reset_servers, server_names

    if config.local_store_scope == "host":
        from sglang_simm.local_store.admin import pid_alive
        from sglang_simm.local_store.admin import StorePaths, read_pid, store_dir

        # a store process already serving that name is someone else's
        root = store_dir(config.client_flags.get("local_store_dir") or None)
        created = not pid_alive(read_pid(StorePaths(root, config.local_store_name)))
    else:
        created = config.is_local_store and config.local_store_name not in set(server_names())
    try:
        yield
    finally:
        if created:
            reset_servers(config.local_store_name)


# ------------------------------------------------------------------ output


def _rate(gbps: float | None) -> str:
    if gbps is None:
        return "-"
    return f"{gbps:.2f} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.1f} MB/s"


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def render_table(console: Any, result: DemoResult) -> None:
    from rich.table import Table

    table = Table(title=f"HiCache L3 phases ({result.info.get('mode', '?')} path)")
    for col in ("phase", "pages", "hit rate", "bytes", "time", "speed"):
        table.add_column(col, justify="left" if col == "phase" else "right", no_wrap=True)
    for p in result.phases:
        rate = "-" if p.hit_rate is None else f"{p.hit_rate:.2f} ({p.hits}/{p.pages})"
        pages = f"{p.pages_moved}/{p.pages}" if p.kind == "write" else f"{p.pages_moved}"
        table.add_row(f"{p.request}: {p.name}", pages, rate, human(p.bytes), _duration(p.seconds),
                      _rate(p.gbps))
    console.print(table)
    ref = result.info.get("memcpy_reference")
    writes = [p for p in result.phases if p.kind == "write" and p.gbps]
    if ref and writes:
        new, in_use = ref["new_memory_gbps"], ref["memory_in_use_gbps"]
        shares = ", ".join(f"{p.request} {p.name} {p.gbps / new:.0%} / {p.gbps / in_use:.0%}" for p in writes)
        console.print(
            f"memcpy of {human(ref['bytes'])} of the host pool with the store's copy routine, same run: "
            f"into {ref['memory']} {_rate(new)}, into the same memory again {_rate(in_use)}. "
            f"Write-backs against those two: {shares}. A write into memory the store has not used yet "
            "waits for the kernel to allocate, zero and map every page first.",
            soft_wrap=False,
        )


def write_json(path: str, result: DemoResult) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result.as_dict(), fh, indent=2, default=str)
        fh.write("\n")


class Runner(Protocol):
    """A demo: its checks raise ``DemoFailure``; ``result`` fills as it goes."""

    result: DemoResult

    def run(self) -> Any: ...


def run_command(console: Any, make: Callable[[], Runner], json_path: str | None, *, verified: str) -> int:
    """Build a demo, run it and report. 0: every check passed; 1: a check
    failed; 2: the demo could not run with these options here."""
    try:
        runner = make()
    except (ValueError, DemoSetupError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return EXIT_SETUP
    code = EXIT_OK
    try:
        runner.run()
    except DemoFailure as exc:
        runner.result.error = str(exc)
        console.print(f"[red]FAILED:[/red] {exc}")
        code = EXIT_FAILED
    except DemoSetupError as exc:
        runner.result.error = str(exc)
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_SETUP
    except Exception as exc:  # a bug or an SGLang this demo does not know: show it, keep the JSON
        runner.result.error = f"{type(exc).__name__}: {exc}"
        console.print_exception()
        code = EXIT_FAILED
    result = runner.result
    if result.phases:
        render_table(console, result)
    if code == EXIT_OK:
        console.print(
            f"[green]all checks passed[/green]: {result.verified_pages} {verified} "
            f"({human(result.verified_bytes)}) match what was written, byte for byte; "
            f"{result.total_seconds:.1f} s, peak memory {human(peak_rss_bytes())}")
    if json_path:
        write_json(json_path, result)
        console.print(f"results written to {json_path}")
    return code
