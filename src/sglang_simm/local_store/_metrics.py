"""The store's counters as Prometheus text, and over HTTP when asked.

Named like SGLang's own metrics (``sglang_simm:store_<name>``), one sample
per store labelled ``store="NAME"`` and ``dir``: ``sglang-simm store status
--prometheus`` prints them (for a node exporter's textfile collector), and
a store process started with ``SGLANG_SIMM_STORE_METRICS_PORT`` in its
environment answers ``GET /metrics`` with the same text (from a thread that
asks the store over its own socket, sharing no state with its loop).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from sglang_simm.local_store._limits import REFUSALS

PREFIX = "sglang_simm:store_"
PORT_ENV, HOST_ENV = "SGLANG_SIMM_STORE_METRICS_PORT", "SGLANG_SIMM_STORE_METRICS_HOST"
logger = logging.getLogger("sglang_simm.local_store")

#: (status field, metric name, type, help)
_FAMILIES = (
    ("objects", "objects", "gauge", "Objects stored"),
    ("used_bytes", "used_bytes", "gauge", "Bytes of objects stored"),
    ("capacity_bytes", "capacity_bytes", "gauge", "Object bytes the store holds at most"),
    ("committed_bytes", "committed_bytes", "gauge", "End of the memory backed in the store's own segment"),
    ("reserved_bytes", "reserved_bytes", "gauge", "Bytes of puts being copied"),
    ("held_bytes", "earlier_held_bytes", "gauge",
     "Bytes of earlier store processes' segments held until their clients are done"),
    ("open_grants", "grants", "gauge", "Open grants (puts and reads being copied)"),
    ("orphaned_grants", "orphaned_grants", "gauge", "Grants of closed connections, held until their process "
                                                    "has no copy in flight"),
    ("pinned_objects", "pinned_objects", "gauge", "Objects pinned by readers"),
    ("connections", "connections", "gauge", "Client connections open"),
    ("clients", "clients", "gauge", "Client processes connected"),
    ("puts", "puts_total", "counter", "Objects published"),
    ("gets", "gets_total", "counter", "Get entries that reached the store"),
    ("hits", "hits_total", "counter", "Get entries that found their object"),
    ("misses", "misses_total", "counter", "Get entries for an absent key"),
    ("evictions", "evictions_total", "counter", "Objects evicted to make room"),
    ("bytes_in", "bytes_in_total", "counter", "Bytes published"),
    ("bytes_out", "bytes_out_total", "counter", "Bytes handed out to readers"),
    ("checksum_failures", "checksum_failures_total", "counter", "Recovered objects whose checksum failed"),
    ("recovered", "recovered_objects", "gauge", "Objects found in earlier segments at start"),
    ("uptime_s", "uptime_seconds", "gauge", "Seconds since the store process started"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(statuses: list[dict[str, Any]]) -> str:
    """Prometheus text for ``statuses``; a store not running is
    ``store_up 0`` with what its files still hold."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
        lines.extend((f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"))
        for labels, value in samples:
            shown = f"{float(value):g}" if isinstance(value, float) else str(int(value))
            lines.append(f"{PREFIX}{name}{{{labels}}} {shown}")

    def labels(s: dict[str, Any]) -> str:
        return f'store="{_label(str(s["name"]))}",dir="{_label(str(s.get("dir", "")))}"'

    live = [s for s in statuses if s.get("running")]
    family("up", "gauge", "1 while the store process answers", [(labels(s), int(bool(s.get("running"))))
                                                               for s in statuses])
    family("files_bytes", "gauge", "Memory or disk its files hold (a stopped store's too)",
           [(labels(s), s.get("files_bytes", 0)) for s in statuses])
    for field, name, kind, help_text in _FAMILIES:
        family(name, kind, help_text, [(labels(s), len(v) if isinstance(v := s.get(field, 0), list) else v)
                                       for s in live])
    family("refusals_total", "counter", "Requests or connections refused, by reason",
           [(f'{labels(s)},reason="{r}"', s.get(f"refused_{r}", 0)) for s in live for r in REFUSALS])
    return "\n".join(lines) + "\n"


def serve_from_env(root: str, name: str, environ: Any = None) -> Any:
    """Serve ``GET /metrics`` where the environment asks for it (None where it
    does not, or where the port is taken: logged, the store serves on)."""
    environ = os.environ if environ is None else environ
    port = environ.get(PORT_ENV)
    if not port:
        return None
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                from sglang_simm.local_store._handle import running_status

                body, status = render_metrics([running_status(root, name)]).encode(), 200
            except Exception as exc:  # the store answers later; say why now
                body, status = f"# the store did not answer: {exc}\n".encode(), 503
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("metrics http: " + fmt, *args)

    host = environ.get(HOST_ENV) or "127.0.0.1"
    try:
        server = ThreadingHTTPServer((host, int(port)), Handler)
    except (OSError, ValueError) as exc:
        logger.warning("store %r: cannot serve /metrics on %s:%s (%s); set %s to a free port", name, host, port, exc,
                       PORT_ENV)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sglang-simm-store-metrics", daemon=True).start()
    logger.info("store %r: /metrics on http://%s:%d/metrics", name, host, server.server_address[1])
    return server
