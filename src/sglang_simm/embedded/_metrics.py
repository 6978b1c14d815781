"""The local store's counters as Prometheus text (exposition format 0.0.4).

Named like SGLang's own metrics (``sglang:<name>``, here ``sglang_simm:``),
one family per counter, each sample labelled with the store's name, so an
operator's scrape config treats a store like the servers beside it:
``sglang-simm store status --prometheus`` prints it (a node exporter's
textfile collector can pick it up). Pure: a status dict in, text out.
"""

from __future__ import annotations

from typing import Any

from sglang_simm.embedded._limits import REFUSALS

PREFIX = "sglang_simm:store_"

#: (status field, metric name, type, help)
_FAMILIES = (
    ("objects", "objects", "gauge", "Objects stored"),
    ("used_bytes", "used_bytes", "gauge", "Bytes of objects stored"),
    ("capacity_bytes", "capacity_bytes", "gauge", "Object bytes the store holds at most"),
    ("committed_bytes", "shared_memory_bytes", "gauge",
     "Shared memory committed to the arena (a prefix; store_held_bytes counts what the files hold)"),
    ("reserved_bytes", "reserved_bytes", "gauge", "Bytes of puts being copied"),
    ("open_leases", "leases", "gauge", "Open leases (batches being copied)"),
    ("pinned_objects", "pinned_objects", "gauge", "Objects pinned by readers"),
    ("closed_leases", "closed_leases", "gauge", "Leases of closed connections, held until their process fences or exits"),
    ("closed_held_bytes", "closed_held_bytes", "gauge", "Put room held for closed connections' processes"),
    ("connections", "connections", "gauge", "Client connections open"),
    ("clients", "clients", "gauge", "Client processes connected"),
    ("puts", "puts_total", "counter", "Objects published"),
    ("gets", "gets_total", "counter", "Get entries that reached the store"),
    ("hits", "hits_total", "counter", "Get entries that found their object"),
    ("misses", "misses_total", "counter", "Get entries for an absent key"),
    ("evictions", "evictions_total", "counter", "Objects evicted to make room"),
    ("bytes_in", "bytes_in_total", "counter", "Bytes published"),
    ("bytes_out", "bytes_out_total", "counter", "Bytes handed out to readers"),
    ("stale_released_bytes", "stale_released_bytes_total", "counter",
     "Shared memory clients faulted in past the committed arena after a clear, given back"),
    ("recovered", "recovered_objects", "gauge", "Objects taken over from a store process that died"),
    ("uptime_s", "uptime_seconds", "gauge", "Seconds since the store process started"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(statuses: list[dict[str, Any]]) -> str:
    """Prometheus text for the running stores among ``statuses``; a dead
    one is ``sglang_simm:store_up 0`` with the memory it still holds."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP {PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        for labels, value in samples:
            lines.append(f"{PREFIX}{name}{{{labels}}} {float(value):g}" if isinstance(value, float)
                         else f"{PREFIX}{name}{{{labels}}} {int(value)}")

    def store_label(s: dict[str, Any]) -> str:
        return f'store="{_label(str(s["name"]))}"'

    live = [s for s in statuses if s.get("running")]
    family("up", "gauge", "1 while the store process answers",
           [(store_label(s), 1 if s.get("running") else 0) for s in statuses])
    family("held_bytes", "gauge", "Shared memory its files hold (a dead store's too)",
           [(store_label(s), s.get("held_bytes", 0)) for s in statuses])
    for field, name, kind, help_text in _FAMILIES:
        samples = []
        for s in live:
            value = s.get(field, 0)
            samples.append((store_label(s), len(value) if isinstance(value, list) else value))
        family(name, kind, help_text, samples)
    refusals = [
        (f'{store_label(s)},reason="{reason}"', s.get(f"refused_{reason}", 0)) for s in live for reason in REFUSALS
    ]
    family("refusals_total", "counter", "Requests or connections refused, by reason", refusals)
    return "\n".join(lines) + "\n"
