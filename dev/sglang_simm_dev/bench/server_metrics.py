"""SGLang's storage histograms, read from a server's ``/metrics``.

``sglang:prefetch_bandwidth`` and ``sglang:backup_bandwidth`` (GB/s per
operation) and ``sglang:prefetch_pgs`` / ``sglang:backup_pgs`` (pages per
operation) are what each backend reports through ``get_stats()``, needing
``--enable-metrics``. Each backend does its own arithmetic (see
``server_tap`` for Mooncake's), and the buckets are coarse, so quantiles
here are estimates by linear interpolation inside a bucket, the way
Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
import re
import urllib.request

#: the four histograms, in the order they are printed
HISTOGRAMS = ("sglang:prefetch_bandwidth", "sglang:backup_bandwidth", "sglang:prefetch_pgs", "sglang:backup_pgs")

_BUCKET = re.compile(r'^(?P<name>[^{\s]+)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')
_LE = re.compile(r'le="([^"]+)"')


def scrape(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
        return response.read().decode()


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    """``name``'s cumulative buckets ``(upper bound, count)``, summed over
    every other label, sorted by bound (``+Inf`` last)."""
    counts: dict[float, float] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line.strip())
        if not m or m.group("name") != name:
            continue
        le = _LE.search(m.group("labels"))
        if not le:
            continue
        bound = math.inf if le.group(1) in ("+Inf", "Inf") else float(le.group(1))
        counts[bound] = counts.get(bound, 0.0) + float(m.group("value"))
    return sorted(counts.items())


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """``histogram_quantile``: the bucket holding rank ``q * n``, linear
    inside it (from 0 for the first bucket); a rank in ``+Inf`` answers the
    last finite bound. None without observations."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def summary(text: str) -> dict[str, dict[str, float] | None]:
    """Per histogram: observations, and p10 / median / p90 estimates."""
    out: dict[str, dict[str, float] | None] = {}
    for name in HISTOGRAMS:
        cum = buckets(text, name)
        n = cum[-1][1] if cum else 0.0
        out[name] = None if not n else {
            "n": int(n), "p10": quantile(0.1, cum), "median": quantile(0.5, cum), "p90": quantile(0.9, cum),
        }
    return out
