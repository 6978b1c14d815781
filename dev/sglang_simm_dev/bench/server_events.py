"""The subscribers of the ``EVENT_BACKENDS`` servers' L3 event streams, and
what each stream carried.

``ours-events`` is read by a :class:`~sglang_simm_dev.kv_events_sub.Subscriber`
that keeps up (decoding every batch with SGLang's classes);
``ours-events-stalled`` by a :class:`~sglang_simm_dev.kv_events_sub.StalledSubscriber`
that connects and never reads, with the server's high-water mark at
``STALLED_HWM`` batches, so ZMQ drops for it through most of the run. Both
connect once the servers are healthy and stay until the bench stops them.
"""

from __future__ import annotations

from typing import Any

from sglang_simm_dev.bench.server_backends import EVENT_BACKENDS, Environment
from sglang_simm_dev.kv_events_sub import StalledSubscriber, Subscriber

__all__ = ["Listeners"]


class Listeners:
    """One subscriber per event server of ``names``; ``close()`` ends them."""

    def __init__(self, env: Environment, names: list[str]) -> None:
        self.subs: dict[str, Any] = {}
        for name in names:
            if name not in EVENT_BACKENDS:
                continue
            endpoint = env.event_endpoints[name]
            self.subs[name] = Subscriber(endpoint) if name == "ours-events" else StalledSubscriber(endpoint)

    def report(self, metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
        """Per event server: pages announced, dropped and batches (its
        ``/metrics``), and what a reading subscriber received."""
        out: dict[str, dict[str, Any]] = {}
        for name, sub in self.subs.items():
            m = metrics.get(name, {})
            row: dict[str, Any] = {
                "subscriber": "reading" if isinstance(sub, Subscriber) else "stalled (never reads)",
                "pages_announced": int(m.get("sglang_simm:kv_events_pages_total", 0)),
                "pages_dropped": int(m.get("sglang_simm:kv_events_dropped_pages_total", 0)),
                "batches": int(m.get("sglang_simm:kv_events_batches_total", 0)),
            }
            if isinstance(sub, Subscriber):
                received = sub.received
                row["batches_received"] = len(received)
                row["pages_received"] = sum(len(e.block_hashes) for r in received for e in r.batch.events)
                row["undecodable"] = sub.undecodable
            out[name] = row
        return out

    def close(self) -> None:
        for sub in self.subs.values():
            sub.close()
        self.subs = {}
