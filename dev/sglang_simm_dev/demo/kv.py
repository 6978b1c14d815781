"""The KV demo: HiCache's L3 write-back and restore of a real model's pages, on a CPU.

What SGLang does with an L3 storage backend while it serves, replayed with
SGLang's own pieces and a real model's page geometry:

* a real SGLang host KV pool (``pin_memory=False``) holding whole pages;
* the backend attached through SGLang's storage factory, as ``simm``;
* page keys from SGLang's own page hash (``get_storage_hash_str``), chained
  over the token ids of the prefix;
* by default SGLang's own ``HybridCacheController`` (0.5.23) drives the
  backend: its backup thread writes pages back, its prefetch threads look
  pages up and load them, in batches of ``STORAGE_BATCH_SIZE``, exactly as
  in serving. This module plays the radix cache's part: it computes page
  keys, enqueues ``write_storage`` / ``prefetch`` operations, allocates host
  slots for a hit and waits on the acknowledgements. ``--direct`` calls the
  backend's ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` itself,
  batch by batch, the way the controller does.

Phases:

1. write-back: request A's pages (a deterministic byte pattern per page,
   derived from the page's key) go from the host pool to the store;
2. cold restore: the host pool is wiped, A is looked up and loaded into
   other host slots, and every byte is compared with the pattern;
3. request B shares a prefix with A (3/4 of its pages) and then goes on:
   the lookup must find exactly the shared prefix, which is loaded and
   checked; B's new pages are written; finally they are fetched back by
   their chained keys (as a radix cache does after matching a prefix in
   host memory) and checked.

Any missing page, short lookup or differing byte fails the run (exit 1).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from sglang_simm_dev.demo.common import (
    VOCAB_SIZE,
    DemoFailure,
    DemoOptions,
    DemoResult,
    DemoSetupError,
    PageHasher,
    PagePattern,
    Phase,
    Progress,
    human,
    own_local_store,
    quiet_imports,
    resolve_extra,
    run_command,
    sglang_version,
    storage_batch_size,
    wipe,
)
from sglang_simm_dev.demo.drivers import ControllerDriver, DirectDriver, Driver
from sglang_simm_dev.demo.reference import REFERENCE_BYTES, memcpy_reference

logger = logging.getLogger(__name__)

#: Pages in request A when ``--pages`` is not given. With llama3-8b (8 MiB a
#: page) the run moves about 4.5 GB and holds under 4 GiB of KV data.
DEFAULT_PAGES = 192
#: The share of request B's pages that it has in common with request A.
SHARED_FRACTION = 0.75


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# --------------------------------------------------------------------- demo


def resolve_geometry(model: str, page_size: int | None) -> Any:
    from sglang_simm_dev.pools import PRESETS

    if model not in PRESETS:
        raise ValueError(f"{model!r} is not a KV-only preset; those are: {', '.join(PRESETS)}")
    geom = PRESETS[model]
    if page_size is not None:
        if page_size < 1:
            raise ValueError(f"--page-size must be at least 1, got {page_size}")
        geom = dataclasses.replace(geom, page_size=page_size)
    return geom


def split_request(pages: int) -> tuple[int, int]:
    """(shared, new) pages of request B."""
    shared = min(max(1, int(pages * SHARED_FRACTION)), pages - 1)
    return shared, pages - shared


def list_rows() -> list[tuple[str, ...]]:
    """Rows for ``--list-models``: the KV presets."""
    from sglang_simm_dev.pools import PRESETS

    rows = []
    for key, g in PRESETS.items():
        heads = "MLA" if g.is_mla else str(g.head_num)
        dim = f"{g.kv_lora_rank}+{g.qk_rope_head_dim}" if g.is_mla else str(g.head_dim)
        rows.append((key, g.name, str(g.layer_num), heads, dim, str(g.page_size),
                     str(g.dtype).replace("torch.", ""), human(g.page_bytes())))
    return rows


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of the run, as data: the pages ``[first, stop)`` of a
    request, written back (``write``) or looked up and loaded into fresh
    host slots (``read``); the run and its table are built from a list of
    these."""

    name: str
    request: str
    kind: str
    first: int
    stop: int
    #: pages a write must store, or a read must find and load
    want: int
    #: how messages name the phase
    label: str
    #: what the progress bar says
    progress: str
    #: read: the request id SGLang's controller sees
    rid: str = ""
    #: read: a restore must land in other slots than this write's
    relocated_from: str | None = None
    #: read: its slots stay taken until the run ends
    hold: bool = False


@dataclass
class _Request:
    tokens: list[int]
    keys: list[str]


class Demo:
    def __init__(self, console: Any, opts: DemoOptions, extra: dict[str, Any]):
        self.console = console
        self.opts = opts
        self.geom = resolve_geometry(opts.model, opts.page_size)
        self.pages = opts.pages if opts.pages is not None else DEFAULT_PAGES
        if self.pages < 2:
            raise ValueError(f"--pages must be at least 2 (request B shares some and adds some), got {self.pages}")
        if self.geom.is_mla and opts.layout == "page_head":
            raise ValueError("the page_head layout is for MHA models; MLA presets use page_first or page_first_direct")
        self.shared, self.new = split_request(self.pages)
        self.page_bytes = self.geom.page_bytes()
        # Headroom so that every restore lands in other host slots than the
        # pages were written from (SGLang's host allocator reuses freed slots
        # last).
        self.host_pages = self.pages + max(1, self.pages // 4)
        if self.geom.is_mla and opts.layout == "page_first_direct":
            # SGLang 0.5.23's MLATokenToKVPoolHost indexes a page_first_direct
            # buffer (pages first) by layer when it builds its transfer views,
            # so it needs at least as many pages as layers.
            self.host_pages = max(self.host_pages, self.geom.layer_num)
        self.store_pages = self.pages + self.new
        self.extra, self.resolved = resolve_extra(extra)
        self.config = self.resolved.config
        self.result = DemoResult()
        self.progress = Progress(console)
        self.seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**32)
        self.timeout_s = opts.timeout_s or max(120.0, self.pages * 1.0)

    # -- setup ---------------------------------------------------------------

    def _plan_memory(self) -> None:
        host_bytes = self.host_pages * self.page_bytes
        store_bytes = self.store_pages * self.page_bytes if self.config.is_local_store else 0
        if self.config.is_local_store and self.resolved.sources.get("local_store_capacity_bytes") == "default":
            # Room for every page the demo writes (plus the warm-up object),
            # not the local store's general default.
            self.extra["local_store_capacity_bytes"] = store_bytes + (16 << 20)
        need = host_bytes + store_bytes + 2 * self.page_bytes + min(REFERENCE_BYTES, host_bytes)
        available = _available_memory()
        if available is not None and need > 0.9 * available:
            raise DemoSetupError(
                f"{self.pages} pages of {human(self.page_bytes)} need about {human(need)} "
                f"(host pool {human(host_bytes)}"
                + (f", local store {human(store_bytes)}" if store_bytes else "")
                + f"), more than the {human(available)} available: use fewer --pages"
            )

    def _build_driver(self, hasher: PageHasher) -> Driver:
        from sglang_simm.errors import SiMMError

        if not self.opts.direct:
            try:
                return ControllerDriver(self.geom, self.opts.layout, self.host_pages, self.extra, hasher,
                                        self.timeout_s)
            except SiMMError as exc:  # the backend refused to attach: the direct path would too
                raise DemoSetupError(f"the backend could not attach: {exc}") from exc
            except Exception as exc:  # SGLang's controller does not build here
                reason = f"{type(exc).__name__}: {exc}"
                logger.debug("SGLang's controller could not be built", exc_info=True)
                self.result.info["controller_error"] = reason
                self.console.print(
                    f"[yellow]note:[/yellow] SGLang's controller cannot be built here ({reason}); "
                    "calling the backend directly instead")
        try:
            return DirectDriver(self.geom, self.opts.layout, self.host_pages, self.extra)
        except SiMMError as exc:
            raise DemoSetupError(f"the backend could not attach: {exc}") from exc
        except DemoSetupError:
            raise
        except Exception as exc:
            raise DemoSetupError(
                f"could not build SGLang's host pool or attach the backend: {type(exc).__name__}: {exc}"
            ) from exc

    # -- checks --------------------------------------------------------------

    def _check(self, condition: bool, message: str) -> None:
        if not condition:
            raise DemoFailure(message)

    def _ok(self, message: str) -> None:
        self.console.print(f"  [green]ok[/green]  {message}")

    def _fill(self, driver: Driver, pattern: PagePattern, slots: list[int], keys: list[str], what: str) -> None:
        with self.progress.task(f"filling {what}", len(keys)) as update:
            for n, (slot, key) in enumerate(zip(slots, keys), 1):
                pattern.fill(driver.host, slot, key)
                if n % 8 == 0:
                    update(n)

    def _verify(self, driver: Driver, pattern: PagePattern, slots: list[int], keys: list[str],
                page_numbers: Sequence[int], what: str) -> int:
        bad: list[tuple[int, int, int]] = []
        with self.progress.task(f"verifying {what}", len(keys)) as update:
            for n, (slot, key, page) in enumerate(zip(slots, keys, page_numbers), 1):
                offset = pattern.check(driver.host, slot, key)
                if offset is None:
                    self.result.verified_pages += 1
                    self.result.verified_bytes += self.page_bytes
                else:
                    bad.append((page, slot, offset))
                if n % 8 == 0:
                    update(n)
        if bad:
            first = ", ".join(
                f"page {p} (host slot {s}, first differing byte at offset {o} of {self.page_bytes})"
                for p, s, o in bad[:3])
            raise DemoFailure(
                f"{what}: {len(bad)} of {len(keys)} restored pages differ from what was written: {first}"
                + (" ..." if len(bad) > 3 else ""))
        return len(keys)

    def _page_starts(self, indices: Any) -> list[int]:
        return indices[:: self.geom.page_size].tolist()

    # -- the run -------------------------------------------------------------

    def phases(self) -> list[PhaseSpec]:
        """A's write-back and cold restore; B, sharing a prefix with A: the
        prefix hit, the write-back of its new pages and their fetch after the
        prefix (chained keys, as a radix cache asks after matching the prefix
        in host memory)."""
        N, S, M = self.pages, self.shared, self.new
        return [
            PhaseSpec("write-back", "A", "write", 0, N, N, "request A's pages", "write-back: host pool -> store"),
            PhaseSpec("cold restore", "A", "read", 0, N, N, "cold restore", "cold restore: store -> host pool",
                      rid="request-A", relocated_from="write-back"),
            PhaseSpec("prefix hit", "B", "read", 0, N, S, "request B's shared prefix",
                      "request B: lookup and load of the prefix", rid="request-B", hold=True),
            PhaseSpec("write new", "B", "write", S, N, M, "request B's new pages",
                      "request B: write-back of the new pages"),
            PhaseSpec("read new", "B", "read", S, N, M, "request B's new pages after the prefix",
                      "request B: fetch of the new pages", rid="request-B-rest", relocated_from="write new"),
        ]

    def run(self) -> DemoResult:
        t_run = time.perf_counter()
        geom, ps, N, S, M = self.geom, self.geom.page_size, self.pages, self.shared, self.new
        res = self.result
        res.expected_verified_bytes = (N + S + M) * self.page_bytes
        self._plan_memory()
        res.info.update(
            model=self.opts.model, model_name=geom.name, layout=self.opts.layout,
            geometry=dict(layers=geom.layer_num, kv_heads=geom.head_num, head_dim=geom.head_dim,
                          page_size=ps, dtype=str(geom.dtype).replace("torch.", ""), is_mla=geom.is_mla,
                          kv_lora_rank=geom.kv_lora_rank, qk_rope_head_dim=geom.qk_rope_head_dim),
            page_bytes=self.page_bytes, pages=N, shared_pages=S, new_pages=M, host_pool_pages=self.host_pages,
            batch_size=storage_batch_size(), seed=self.seed, sglang_version=sglang_version(),
            manager_address=self.config.manager_address,
        )
        driver = None
        try:
            with own_local_store(self.config):
                try:
                    with quiet_imports():
                        hasher = PageHasher()
                        driver = self._build_driver(hasher)
                    self._announce(driver, hasher)
                    res.info.update(mode=driver.mode, driver=driver.description, hash_function=hasher.source,
                                    hash_fallback_reason=hasher.fallback_reason,
                                    store=getattr(getattr(driver.backend, "client", None), "description", None))
                    self._run_phases(driver, self._requests(hasher))
                    res.ok = True
                    res.info["memcpy_reference"] = self._memcpy_reference(driver)
                finally:
                    if driver is not None:
                        res.info["backend_stats"] = driver.backend_stats()
                        driver.close()
        finally:
            res.total_seconds = time.perf_counter() - t_run
        return res

    def _memcpy_reference(self, driver: Driver) -> dict[str, Any]:
        """The same-run memcpy the write-back is held against (``reference``)."""
        buf = driver.host.kv_buffer
        objects = 1 if self.geom.is_mla else 2
        return memcpy_reference(buf.data_ptr(), buf.numel() * buf.element_size(), self.page_bytes // objects,
                                shared=self.config.local_store_scope == "host")

    def _announce(self, driver: Driver, hasher: PageHasher) -> None:
        g, c = self.geom, self.console
        objects = 1 if g.is_mla else 2
        shape = (f"{g.layer_num} layers, MLA {g.kv_lora_rank}+{g.qk_rope_head_dim}" if g.is_mla
                 else f"{g.layer_num} layers x {g.head_num} KV heads x {g.head_dim}")
        store = getattr(getattr(driver.backend, "client", None), "description", self.config.manager_address)
        c.print(f"[bold]sglang-simm-dev demo[/bold]: HiCache L3 write-back and restore on {store}")
        c.print(f"  model     {g.name} ({shape}, {str(g.dtype).replace('torch.', '')}, "
                f"{g.page_size} tokens a page)")
        c.print(f"  page      {human(self.page_bytes)} = {objects} object(s) of "
                f"{human(self.page_bytes // objects)}, layout {self.opts.layout}")
        c.print(f"  requests  A: {self.pages} pages; B: {self.shared} shared with A + {self.new} new")
        c.print(f"  driver    {driver.description}")
        c.print(f"  keys      {hasher.source}"
                + (f" (SGLang's: {hasher.fallback_reason})" if hasher.fallback_reason else ""))

    def _requests(self, hasher: PageHasher) -> dict[str, _Request]:
        """A's tokens, and B's: A's first ``shared`` pages, then new ones."""
        ps, N, S, M = self.geom.page_size, self.pages, self.shared, self.new
        rng = random.Random(self.seed)
        tokens_a = [rng.randrange(VOCAB_SIZE) for _ in range(N * ps)]
        tokens_b = tokens_a[: S * ps] + [rng.randrange(VOCAB_SIZE) for _ in range(M * ps)]
        keys_a = hasher(tokens_a, ps)
        keys_b = hasher(tokens_b, ps)
        self._check(len(keys_a) == N and len(keys_b) == N, "the page hash did not give one key per page")
        self._check(keys_b[:S] == keys_a[:S] and keys_b[S] != keys_a[S],
                    "the page keys of the shared prefix differ between the two requests")
        self._check(len(set(keys_a + keys_b[S:])) == N + M, "two pages got the same key")
        return {"A": _Request(tokens_a, keys_a), "B": _Request(tokens_b, keys_b)}

    def _run_phases(self, driver: Driver, requests: dict[str, _Request]) -> None:
        pattern = PagePattern(self.page_bytes)
        written: dict[str, list[int]] = {}
        held: list[Any] = []
        for spec in self.phases():
            req = requests[spec.request]
            if spec.kind == "write":
                written[spec.name] = self._write_phase(driver, pattern, spec, req)
            else:
                slots = self._read_phase(driver, pattern, spec, req, written)
                if spec.hold:
                    held.append(slots)
                else:
                    driver.free(slots)
        for slots in held:
            driver.free(slots)

    def _write_phase(self, driver: Driver, pattern: PagePattern, spec: PhaseSpec, req: _Request) -> list[int]:
        """Fill fresh host slots with the pages' patterns and write them back;
        the slots' page starts."""
        ps, n = self.geom.page_size, spec.stop - spec.first
        slots = driver.alloc(n * ps)
        self._check(slots is not None, f"the host pool has no room for {n} more pages")
        starts = self._page_starts(slots)
        keys = req.keys[spec.first:spec.stop]
        self._fill(driver, pattern, starts, keys, spec.label)
        with self.progress.task(spec.progress, n) as update:
            stored, seconds = driver.write(keys, req.tokens[spec.first * ps:spec.stop * ps], slots, update)
        self.result.phases.append(Phase(spec.name, spec.request, "write", n, pages_moved=stored,
                                        page_bytes=self.page_bytes, seconds=seconds))
        self._check(stored == spec.want, f"{spec.label}: write-back stored {stored} of {spec.want} pages")
        self._ok(f"{spec.label}: {n} pages ({human(n * self.page_bytes)}) written back")
        driver.free(slots)
        return starts

    def _read_phase(self, driver: Driver, pattern: PagePattern, spec: PhaseSpec, req: _Request,
                    written: dict[str, list[int]]) -> Any:
        """Look the pages up on a poisoned host pool, load the hit into fresh
        slots and compare every byte; the slots."""
        ps, n = self.geom.page_size, spec.stop - spec.first
        wipe(driver.host)
        keys = req.keys[spec.first:spec.stop]
        after = req.keys[spec.first - 1] if spec.first else None
        with self.progress.task(spec.progress, n) as update:
            hits, loaded, slots, lookup, load = driver.fetch(
                spec.rid, req.tokens[spec.first * ps:spec.stop * ps], keys, after, update)
        phase = Phase(spec.name, spec.request, "read", n, hits=hits, pages_moved=loaded, page_bytes=self.page_bytes,
                      seconds=lookup + load, lookup_seconds=lookup)
        self.result.phases.append(phase)
        self._check(hits == spec.want, f"{spec.label}: the lookup found {hits} of {n} pages "
                                       f"(hit rate {hits / n:.2f}), expected {spec.want}")
        self._check(loaded == spec.want, f"{spec.label}: {loaded} of {spec.want} pages loaded")
        starts = self._page_starts(slots)
        moved = ""
        if spec.relocated_from is not None:
            phase.relocated_pages = sum(a != b for a, b in zip(starts, written[spec.relocated_from]))
            moved = f" into other host slots ({phase.relocated_pages} moved)"
        phase.verified_pages = self._verify(driver, pattern, starts, keys[:hits],
                                            range(spec.first, spec.first + hits), spec.label)
        self._ok(f"{spec.label}: the lookup found {hits} of {n} pages, all loaded{moved}, every byte checked")
        return slots


def run(console: Any, opts: DemoOptions, extra: dict[str, Any]) -> int:
    """The KV demo, reported (``common.run_command``)."""
    return run_command(console, lambda: Demo(console, opts, extra), opts.json_path, verified="restored pages")
