"""The local store's ``/metrics`` over HTTP, opt-in: scraped like Mooncake's master.

Set ``SGLANG_SIMM_STORE_METRICS_PORT`` (and, to listen elsewhere than
127.0.0.1, ``SGLANG_SIMM_STORE_METRICS_HOST``) in the environment a store
process starts in (``sglang-simm store start``, or the server whose first
scheduler starts it): the store then answers ``GET /metrics`` with the same
text as ``sglang-simm store status --prometheus`` (``embedded/_metrics.py``).

The HTTP server is a thread of the store process that reads the store
through the store's own socket, as ``store status`` does, so it shares no
state with the store's loop. Unset (the default), nothing here runs.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

PORT_ENV = "SGLANG_SIMM_STORE_METRICS_PORT"
HOST_ENV = "SGLANG_SIMM_STORE_METRICS_HOST"

logger = logging.getLogger("sglang_simm.store_http")


def serve(render: Callable[[], str], port: int, host: str = "127.0.0.1") -> Any:
    """An HTTP server on ``host:port`` answering ``GET /metrics`` with
    ``render()``, in a daemon thread; returns it (``shutdown()`` stops it)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body, status = render().encode(), 200
            except Exception as exc:  # the store answers later; say why now
                body, status = f"# the store did not answer: {exc}\n".encode(), 503
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("metrics http: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="store-metrics-http", daemon=True).start()
    return server


def store_metrics_from_env(root: str, name: str, environ: Any = None) -> Any:
    """The store process's hook: serve its metrics where the environment
    asks for it (None where it does not, or where the port is taken: logged,
    the store serves on)."""
    environ = os.environ if environ is None else environ
    port = environ.get(PORT_ENV)
    if not port:
        return None
    host = environ.get(HOST_ENV) or "127.0.0.1"

    def render() -> str:
        from sglang_simm.embedded._host import running_status
        from sglang_simm.embedded._metrics import render as render_text

        status = running_status(root, name)
        return render_text([status])

    try:
        server = serve(render, int(port), host)
    except (OSError, ValueError) as exc:
        logger.warning("store %r: cannot serve /metrics on %s:%s (%s); set %s to a free port", name, host, port,
                       exc, PORT_ENV)
        return None
    logger.info("store %r: /metrics on http://%s:%d/metrics", name, host, server.server_address[1])
    return server
