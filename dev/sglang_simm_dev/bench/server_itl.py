"""What L3 costs the requests already running: decoders' inter-token latency
while other clients' prompts are backed up to L3 and read back from it.

SGLang runs a storage backend's threads (prefetch, backup) in the
scheduler's process, so every GIL hold of a backend delays the scheduler's
next decode step: the decoders see it as a longer gap between two tokens.
The workload, on one server at a time:

1. **stored**: ``itl_stored`` prompts of ``itl_bg_tokens`` are sent and, on
   an L3 backend, waited for until their pages are in L3; then
   ``/flush_cache`` empties the device and host tiers (nothing is in flight
   yet), so these prompts can come back from L3 only;
2. **decoders**: ``itl_decoders`` clients each stream a long answer
   (``itl_answer_tokens``, ``"stream": true``) of a short prompt of their
   own; every chunk's arrival time and token count is kept;
3. **background**: once every decoder has ``itl_lead_tokens`` tokens, a
   client sends, in a seeded order, the stored prompts again (L3
   prefetches) interleaved with ``itl_fresh`` new prompts of the same length
   (prefills whose pages are backed up), one output token each, each
   request once every decoder has ``itl_bg_spacing_tokens`` more tokens
   than at the previous answer (paced in decode steps, not seconds, so
   every backend's decoders take the same number of steps per background
   request, whatever the machine's speed); the window runs from the first
   request to ``itl_bg_spacing_tokens`` steps after the last answer (its
   backup included).

Inter-token latency: a chunk carrying ``k`` new tokens ``dt`` after the
previous one counts ``k`` tokens of ``dt / k`` each (SGLang streams every
token by default, so ``k`` is 1 but for a late reader); ``max`` is the
longest single gap. Each gap that ends inside the window is either

* ``under``: a decode step while the background's L3 reads and writes run
  on the backend's threads in the scheduler's process: the ruler, where a
  backend's GIL holds show;
* ``prefill``: a gap holding a background request's prefill (its first
  token arrived in it, or up to ``PREFILL_SLACK_S`` before its end): the
  scheduler ran a prefill batch between two decode steps. Backends without
  L3 (``host``, ``none``) recompute the stored prompts, so theirs are
  longer; kept apart so that the ruler compares decode steps, not prefills;

and ``quiet`` counts the gaps outside the window with no prefill in them
(the same decoders on the same server without background traffic: that
server's own noise floor). The same seeded prompts go to every backend;
``background`` in the result says what each tier served.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from sglang_simm_dev.bench.server_workloads import Backups, Workload, matchable, store_for_restart, tokens
from sglang_simm_dev.sglang_server import SGLangServer, ServerError, sse_chunks

#: the goal: the decoders' p99 inter-token latency under L3 traffic, ours
#: over no L3, at most this (and no worse than the peers')
ITL_GOAL_RATIO = 1.05

#: how far before a decoder's gap ends a background request's first token
#: may have been read and still count as that gap's prefill (the threads
#: reading the streams run on a loaded machine too)
PREFILL_SLACK_S = 0.02


@dataclass
class Stream:
    """One streamed answer: every chunk that carried new tokens, as
    ``(seconds since the request was sent, output tokens so far)``."""

    started: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)


def sse_payloads(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON of every ``data:`` line of a server-sent-events body, up to
    ``[DONE]``; an ``error`` payload raises."""
    for chunk in sse_chunks(lines):
        if "error" in chunk and "output_ids" not in chunk:
            raise ServerError(f"the stream answered an error: {chunk['error']}")
        yield chunk


def read_stream(lines: Iterable[bytes], started: float, clock: Callable[[], float] = time.perf_counter,
                on_tokens: Callable[[int], None] = lambda n: None) -> Stream:
    """Time every chunk of a ``/generate`` stream as it arrives. SGLang's
    chunks carry every output id so far (its default, non-incremental
    streaming) and ``meta_info.completion_tokens``; a chunk that adds no
    token (the last one may repeat the previous) is not a token."""
    out = Stream(started=started)
    ids: list[int] = []
    for chunk in sse_payloads(lines):
        now = clock()
        meta = chunk.get("meta_info") or {}
        new = list(chunk.get("output_ids") or [])
        # incremental streaming (a server flag) sends only the new ids
        ids = new if len(new) >= len(ids) and new[: len(ids)] == ids else ids + new
        count = int(meta.get("completion_tokens") or len(ids))
        if not out.counts or count > out.counts[-1]:
            out.times.append(now - started)
            out.counts.append(count)
            on_tokens(count)
        out.prompt_tokens = int(meta.get("prompt_tokens") or out.prompt_tokens)
        details = meta.get("cached_tokens_details") or {}
        out.cached = {k: int(details.get(k) or 0) for k in ("device", "host", "storage")}
    out.output_ids = ids
    if not out.counts:
        raise ServerError("the stream ended without a token")
    return out


def stream_generate(server: SGLangServer, input_ids: Sequence[int], max_new_tokens: int, *,
                    on_tokens: Callable[[int], None] = lambda n: None, timeout: float = 600.0) -> Stream:
    """Greedy ``/generate`` with ``"stream": true`` (no logprobs: the chunks
    stay small), each chunk timed on arrival."""
    body = {"input_ids": [int(t) for t in input_ids], "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    started = time.perf_counter()
    with server._request("/generate", body, timeout=timeout) as response:
        return read_stream(response, started, on_tokens=on_tokens)


def gaps(stream: Stream) -> list[tuple[float, float, int]]:
    """``(arrival, seconds since the previous chunk, new tokens)`` for every
    chunk after the first (arrivals in seconds since the stream's start)."""
    return [(stream.times[i], stream.times[i] - stream.times[i - 1], stream.counts[i] - stream.counts[i - 1])
            for i in range(1, len(stream.times))]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def itl_stats(per_token: Sequence[float], stalls: Sequence[float]) -> dict[str, Any] | None:
    """p50 / p99 of the per-token latencies, the longest gap, seconds."""
    if not per_token:
        return None
    return {"p50": percentile(per_token, 0.5), "p99": percentile(per_token, 0.99), "max": max(stalls),
            "mean": sum(per_token) / len(per_token), "tokens": len(per_token)}


SIDES = ("under", "prefill", "quiet")


def split(streams: Sequence[Stream], window: tuple[float, float], prefills: Sequence[float] = (),
          slack: float = PREFILL_SLACK_S, steady_from: float = -math.inf) -> dict[str, tuple[list[float], list[float]]]:
    """Per-token latencies and gaps by side (module doc): ``window`` and
    ``prefills`` (background first tokens) in the streams' clock; gaps that
    end by ``steady_from`` (+ slack: every decoder's first token, so the
    decoders' own prefills) are none of them."""
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in SIDES}
    lo, hi = window
    for s in streams:
        for at, dt, k in gaps(s):
            end = s.started + at
            if k <= 0 or end <= steady_from + slack:
                continue
            if any(end - dt < p <= end + slack for p in prefills):
                side = out["prefill"]
            else:
                side = out["under" if lo <= end <= hi else "quiet"]
            side[0].extend([dt / k] * k)
            side[1].append(dt)
    return out


def prompts(w: Workload, seed: int, vocab: int) -> dict[str, Any]:
    """The workload's seeded prompts: decoders', stored, fresh, and the
    background order (``("stored" | "fresh", index)``)."""
    rng = random.Random(seed)
    decoders = [tokens(rng, w.itl_prompt_tokens, vocab) for _ in range(w.itl_decoders)]
    stored = [tokens(rng, w.itl_bg_tokens, vocab) for _ in range(w.itl_stored)]
    fresh = [tokens(rng, w.itl_bg_tokens, vocab) for _ in range(w.itl_fresh)]
    order = [("stored", i) for i in range(w.itl_stored)] + [("fresh", i) for i in range(w.itl_fresh)]
    rng.shuffle(order)
    return {"decoders": decoders, "stored": stored, "fresh": fresh, "order": order}


def decode_under_l3(server: SGLangServer, backups: Backups | None, w: Workload, seed: int, vocab: int,
                    wait_s: float = 600.0) -> dict[str, Any]:
    """The workload (module doc) on one server: its streamed token times,
    the window, what the background got from each tier, the ITL figures."""
    p = prompts(w, seed, vocab)
    page = server.config.page_size
    if backups is not None:
        stored = store_for_restart(server, backups, p["stored"], w)
        backup_s = stored.backup_s
    else:
        for prompt in p["stored"]:
            server.generate(prompt, max_new_tokens=w.new_tokens)
        backup_s = None
    server.flush_cache()
    # each decoder sets its event at its lead (or when it ends): never blocks its reading
    lead = [threading.Event() for _ in range(w.itl_decoders)]
    results: list[Stream | BaseException | None] = [None] * w.itl_decoders
    done = [False] * w.itl_decoders
    progress = [0] * w.itl_decoders
    moved = threading.Condition()

    def on_progress(i: int, n: int | None) -> None:
        with moved:
            if n is None:
                done[i] = True
            else:
                progress[i] = n
            moved.notify_all()

    def steps_after(base: int) -> int:
        """Wait until every decoder still decoding has ``base +
        itl_bg_spacing_tokens`` tokens; the least count then."""
        with moved:
            moved.wait_for(lambda: all(d or n >= base + w.itl_bg_spacing_tokens for d, n in zip(done, progress)),
                           timeout=wait_s)
            return min(progress)

    def decoder(i: int) -> None:
        def on_tokens(n: int) -> None:
            on_progress(i, n)
            if n >= w.itl_lead_tokens:
                lead[i].set()

        try:
            results[i] = stream_generate(server, p["decoders"][i], w.itl_answer_tokens, on_tokens=on_tokens,
                                         timeout=wait_s)
        except BaseException as exc:  # noqa: BLE001 - raised again from the caller's thread
            results[i] = exc
        finally:
            on_progress(i, None)
            lead[i].set()

    threads = [threading.Thread(target=decoder, args=(i,), daemon=True) for i in range(w.itl_decoders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    for e in lead:
        e.wait(timeout=max(0.0, deadline - time.monotonic()))
    background: list[dict[str, Any]] = []
    window_start = time.perf_counter()

    def send(item: tuple[str, int]) -> dict[str, Any]:
        kind, i = item
        sent = time.perf_counter()
        g = server.generate(p[kind][i], max_new_tokens=1, stream=True)
        ttft = g.ttft_s or g.latency_s
        return {"kind": kind, "prompt_tokens": g.prompt_tokens, "ttft_s": ttft,
                #: its first token's arrival, seconds after the window's start
                "first_token_s": sent + ttft - window_start,
                "cached": {"device": g.device_tokens, "host": g.host_tokens, "storage": g.storage_tokens}}

    with moved:
        base = min(progress)
    for k, item in enumerate(p["order"]):
        if k:
            base = steps_after(base)
        background.append(send(item))
        with moved:
            base = min(progress)
    steps_after(base)
    window_end = time.perf_counter()
    for t in threads:
        t.join(timeout=wait_s)
    failed = [r for r in results if not isinstance(r, Stream)]
    if failed:
        why = failed[0]
        cause = why if isinstance(why, BaseException) else None
        raise ServerError(f"{server.name}: a decoder failed: {why!r}") from cause
    streams: list[Stream] = results  # type: ignore[assignment]
    if backups is not None:
        backups.settle()
    steady = max(s.started + s.times[0] for s in streams)
    parts = split(streams, (window_start, window_end), [window_start + b["first_token_s"] for b in background],
                  steady_from=steady)
    decoders_end = min(s.started + s.times[-1] for s in streams)
    span = max(window_end - window_start, 1e-9)
    stored_reads = [b for b in background if b["kind"] == "stored"]
    return {
        "window_s": window_end - window_start,
        #: the last decoder's first token, seconds after the window's start (negative: before it)
        "steady_from_s": steady - window_start,
        #: share of the window during which every decoder was still decoding
        "covered": max(0.0, min(1.0, (decoders_end - window_start) / span)),
        "backup_s": backup_s,
        "backed_up": backups is None or backup_s is not None,
        "expected_l3_tokens": matchable(w.itl_bg_tokens, page) * len(stored_reads),
        "l3_tokens": sum(b["cached"]["storage"] for b in stored_reads),
        "background": background,
        "decoders": [{"window_offset_s": window_start - s.started, "times_s": [round(t, 6) for t in s.times],
                      "counts": s.counts, "output_ids": s.output_ids, "cached": s.cached} for s in streams],
        "itl": {k: itl_stats(*v) for k, v in parts.items()},
    }


def pooled(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-token latencies of every repetition together, by side, from the
    kept token times."""
    sides: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in SIDES}
    for rep in reps:
        for d in rep["decoders"]:
            s = Stream(started=0.0, times=d["times_s"], counts=d["counts"])
            lo = d["window_offset_s"]
            got = split([s], (lo, lo + rep["window_s"]), [lo + b["first_token_s"] for b in rep["background"]],
                        steady_from=lo + rep.get("steady_from_s", -math.inf))
            for k in sides:
                sides[k][0].extend(got[k][0])
                sides[k][1].extend(got[k][1])
    out: dict[str, Any] = {k: itl_stats(*v) for k, v in sides.items()}
    out["covered"] = min((r["covered"] for r in reps), default=None)
    out["l3_tokens"] = sum(r["l3_tokens"] for r in reps)
    out["expected_l3_tokens"] = sum(r["expected_l3_tokens"] for r in reps)
    return out


def against(summary: dict[str, dict[str, Any]], reference: str) -> dict[str, dict[str, float | None]]:
    """Each backend's ``under`` p50 / p99 / max over ``reference``'s."""
    ref = (summary.get(reference) or {}).get("under") or {}
    out: dict[str, dict[str, float | None]] = {}
    for name, d in summary.items():
        mine = d.get("under") or {}
        out[name] = {q: (mine[q] / ref[q] if mine.get(q) is not None and ref.get(q) else None)
                     for q in ("p50", "p99", "max")}
    return out


__all__ = ["ITL_GOAL_RATIO", "PREFILL_SLACK_S", "SIDES", "Stream", "against", "decode_under_l3", "gaps", "itl_stats",
           "percentile", "pooled", "prompts", "read_stream", "split", "sse_payloads", "stream_generate"]
