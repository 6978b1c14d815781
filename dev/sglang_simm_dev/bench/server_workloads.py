"""The requests ``bench --server`` sends to each backend's server.

* ``long_prompt``: one long prompt from scratch, then again once other
  traffic pushed it off the device pool (from the host tier), then again
  after ``/flush_cache`` (from L3); both repeats checked against the first
  answer, token ids and logprobs bit for bit.
* ``multi_turn``: the shape of SGLang's ``benchmark/hicache/bench_multiturn.py``:
  ``clients`` conversations side by side for ``rounds`` rounds; each round
  sends a client's whole history plus a new user turn, all clients at once;
  per round the time to first token and the share of prompt tokens each
  tier served (``cached_tokens_details``). A turn's answer goes into the
  history as fixed tokens, so every backend sees the same prompts; answers
  are compared across backends afterwards.
* ``itl`` (``server_itl``): clients decoding long answers while other
  clients' prompts are backed up to L3 and read back from it; the
  decoders' inter-token latency.
* ``restart``: prompts stored in L3, the server restarted on the same L3
  (its files dropped from the page cache in between, where they are on a
  disk), the prompts sent again: how many come back from L3, how fast
  (TTFT), and are they the same answers.

Prompts are random token ids from a seed (one seed per repetition, so one
repetition never hits another's pages).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_simm_dev.bench.server_tap import read_ops
from sglang_simm_dev.sglang_server import Generation, SGLangServer


@dataclass(frozen=True)
class Workload:
    """Sizes of the three workloads."""

    long_tokens: int = 3056
    #: tokens of other traffic sent between the first and second long request
    #: (at least the device pool, so the prompt leaves it)
    filler_tokens: int = 4096
    filler_chunk: int = 1024
    #: the prompt that pays a server's one-off costs first (0: the long prompt's length)
    warmup_tokens: int = 0
    new_tokens: int = 8
    clients: int = 8
    rounds: int = 4
    turn_tokens: int = 512
    #: the fixed "answer" appended to a history after each turn
    answer_tokens: int = 32
    restart_prompts: int = 5
    restart_tokens: int = 1024
    #: decoders under L3 traffic (``server_itl``): clients streaming long answers
    itl_decoders: int = 2
    itl_prompt_tokens: int = 64
    itl_answer_tokens: int = 384
    #: tokens every decoder has before the background starts
    itl_lead_tokens: int = 16
    #: background prompts stored in L3, then read back during the decoding
    itl_stored: int = 6
    #: background prompts new to the server (prefilled, then backed up)
    itl_fresh: int = 6
    itl_bg_tokens: int = 1024
    #: decode steps between a background answer and the next request
    itl_bg_spacing_tokens: int = 16


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random ids above the special ids 0..2."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def matchable(length: int, page_size: int) -> int:
    """The prefix a re-sent prompt can get from a cache: SGLang computes the
    last token, and caches whole pages only."""
    return (length - 1) // page_size * page_size


def same_answer(a: Generation, b: Generation) -> bool:
    return a.output_ids == b.output_ids and a.logprobs == b.logprobs


def tiers(g: Generation) -> dict[str, int]:
    return {"device": g.device_tokens, "host": g.host_tokens, "storage": g.storage_tokens}


#: how long the pages of an answered request may take to reach L3
BACKUP_WAIT_S = 60.0


class Backups:
    """Pages a server's L3 backend confirmed stored, from its tap folder."""

    def __init__(self, tap_dir: str) -> None:
        self.tap_dir = tap_dir

    def stored(self, since: float = 0.0) -> int:
        return sum(o.ok for o in read_ops(self.tap_dir, since) if o.op == "set")

    def wait(self, at_least: int, since: float, timeout: float = BACKUP_WAIT_S) -> float | None:
        """Until ``at_least`` pages were stored since ``since`` (backups run
        after the answer, while the scheduler is idle: with
        ``--sleep-on-idle`` it polls once a second, and its loop is what
        hands finished host writes to the backup thread). Seconds waited,
        or None on timeout."""
        start = time.monotonic()
        while self.stored(since) < at_least:
            if time.monotonic() - start > timeout:
                return None
            time.sleep(0.1)
        return time.monotonic() - start

    def settle(self, quiet_s: float = 1.0, timeout: float = 120.0) -> None:
        """Until no call was recorded for ``quiet_s`` (the backup thread is
        done), so its work does not overlap the next server's timings."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ops = read_ops(self.tap_dir)
            last = ops[-1].t if ops else 0.0
            if time.time() - last >= quiet_s:
                return
            time.sleep(0.2)


@dataclass
class Request:
    """One timed request: what was asked, what answered, from which tier."""

    label: str
    prompt_tokens: int
    ttft_s: float
    cached: dict[str, int]
    #: matches its reference (None: compared later, across backends)
    ok: bool | None
    output_ids: list[int] = field(default_factory=list)


def _req(label: str, g: Generation, ok: bool | None) -> Request:
    return Request(label, g.prompt_tokens, g.ttft_s or g.latency_s, tiers(g), ok, list(g.output_ids))


def long_prompt(server: SGLangServer, backups: Backups | None, w: Workload, seed: int, vocab: int) -> dict[str, Any]:
    """Scratch, host tier, L3: three TTFTs of one prompt (see module doc)."""
    rng = random.Random(seed)
    prompt = tokens(rng, w.long_tokens, vocab)
    page = server.config.page_size
    # one-off costs (first prefill of this length, allocations) on a prompt of its own
    server.generate(tokens(rng, w.warmup_tokens or w.long_tokens, vocab), max_new_tokens=1, extra_key=f"warm-{seed}")
    if backups is not None:
        backups.settle()
    t0 = time.time()
    scratch = server.generate(prompt, max_new_tokens=w.new_tokens, stream=True)
    backup_s = None
    if backups is not None:
        backup_s = backups.wait((scratch.prompt_tokens + w.new_tokens - 1) // page, since=t0)
    sent = 0
    while sent < w.filler_tokens:
        server.generate(tokens(rng, w.filler_chunk, vocab), max_new_tokens=1)
        sent += w.filler_chunk
    if backups is not None:
        backups.settle()
    host = server.generate(prompt, max_new_tokens=w.new_tokens, stream=True)
    server.flush_cache()
    l3 = server.generate(prompt, max_new_tokens=w.new_tokens, stream=True)
    if backups is not None:
        backups.settle()
    return {
        "expected_prefix": matchable(w.long_tokens, page),
        "backed_up": backups is None or backup_s is not None,
        #: seconds from the answer until its pages were in L3 (idle scheduler)
        "backup_s": backup_s,
        "requests": [asdict(_req("scratch", scratch, True)), asdict(_req("after traffic", host, same_answer(host, scratch))),
                     asdict(_req("after flush", l3, same_answer(l3, scratch)))],
    }


def conversation_prompts(w: Workload, seed: int, vocab: int) -> list[list[list[int]]]:
    """``[round][client]`` prompts: each client's history grows by its fixed
    answer and a new turn every round."""
    rng = random.Random(seed)
    histories = [tokens(rng, w.turn_tokens, vocab) for _ in range(w.clients)]
    rounds = [[list(h) for h in histories]]
    for _ in range(1, w.rounds):
        for c in range(w.clients):
            histories[c] = histories[c] + tokens(rng, w.answer_tokens, vocab) + tokens(rng, w.turn_tokens, vocab)
        rounds.append([list(h) for h in histories])
    return rounds


def multi_turn(server: SGLangServer, backups: Backups | None, w: Workload, seed: int, vocab: int) -> dict[str, Any]:
    """Every round's requests sent at once; per-round TTFT and tier shares."""
    prompts = conversation_prompts(w, seed, vocab)
    server.flush_cache()
    out: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=w.clients) as pool:
        for r, batch in enumerate(prompts):
            answers = list(pool.map(lambda p: server.generate(p, max_new_tokens=w.new_tokens, stream=True), batch))
            prompt_total = sum(g.prompt_tokens for g in answers)
            shares = {tier: sum(tiers(g)[tier] for g in answers) / prompt_total for tier in ("device", "host", "storage")}
            out.append({
                "round": r + 1,
                "ttft_s": [g.ttft_s or g.latency_s for g in answers],
                "hit_rate": sum(g.cached_tokens for g in answers) / prompt_total,
                "tier_share": shares,
                "output_ids": [list(g.output_ids) for g in answers],
            })
    if backups is not None:
        backups.settle()
    return {"rounds": out}


def restart_prompts(w: Workload, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokens(rng, w.restart_tokens, vocab) for _ in range(w.restart_prompts)]


@dataclass
class Stored:
    """The restart's prompts as answered before the stop."""

    answers: list[Generation]
    #: seconds until their pages were in L3; None: not within ``BACKUP_WAIT_S``
    backup_s: float | None


def store_for_restart(server: SGLangServer, backups: Backups, prompts: Sequence[list[int]], w: Workload) -> Stored:
    """Send the prompts and wait until their pages are in L3."""
    t0 = time.time()
    page = server.config.page_size
    answers = [server.generate(p, max_new_tokens=w.new_tokens, stream=True) for p in prompts]  # as after the restart
    waited = backups.wait(sum((g.prompt_tokens + w.new_tokens - 1) // page for g in answers), since=t0)
    backups.settle()
    return Stored(answers, waited)


def after_restart(server: SGLangServer, backups: Backups | None, prompts: Sequence[list[int]], before: Stored,
                  w: Workload, seed: int, vocab: int) -> dict[str, Any]:
    """The prompts again on the restarted server: full L3 hits, same
    answers, and each one's time to first token. A new prompt of the same
    length goes first, so the server's one-off costs (a first prefill of
    that length) are paid outside the timed requests; its backups are let
    finish before them."""
    page = server.config.page_size
    server.generate(tokens(random.Random(seed), len(prompts[0]) if prompts else w.restart_tokens, vocab),
                    max_new_tokens=1, extra_key=f"warm-restart-{seed}")
    if backups is not None:
        backups.settle()
    hits = same = 0
    ttft: list[float] = []
    storage: list[int] = []
    for p, want in zip(prompts, before.answers):
        g = server.generate(p, max_new_tokens=w.new_tokens, stream=True)
        hits += g.storage_tokens == matchable(len(p), page)
        same += same_answer(g, want)
        ttft.append(g.ttft_s or g.latency_s)
        storage.append(g.storage_tokens)
    return {"prompts": len(prompts), "l3_hits": hits, "same_answers": same,
            "backed_up": before.backup_s is not None, "backup_s": before.backup_s,
            "ttft_s": ttft, "l3_tokens": storage, "expected_l3_tokens": [matchable(len(p), page) for p in prompts]}


def rotated(names: Sequence[str], rep: int) -> list[str]:
    """``names`` started at position ``rep`` (each repetition its own order)."""
    k = rep % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def compare_turns(results: dict[str, list[dict[str, Any]]], reference: str) -> dict[str, dict[str, int]]:
    """Per backend, how many multi-turn answers equal ``reference``'s (same
    repetition, round and client): ``{"same": n, "of": m}``."""
    out: dict[str, dict[str, int]] = {}
    ref_reps = results.get(reference) or []
    for name, reps in results.items():
        same = total = 0
        for rep, ref in zip(reps, ref_reps):
            for rnd, ref_rnd in zip(rep["rounds"], ref["rounds"]):
                for a, b in zip(rnd["output_ids"], ref_rnd["output_ids"]):
                    total += 1
                    same += a == b
        out[name] = {"same": same, "of": total}
    return out


Progress = Callable[[str], None]
