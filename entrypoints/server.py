"""``infer serve``'s HTTP server: the app under uvicorn with the configuration's address,
TLS, connection limits, logging and drain (:mod:`adapters.http.uvicorn_server`)."""

from typing import Any

from adapters.http.ownership import Draining
from adapters.http.uvicorn_server import run_server
from entrypoints.config import ServerConfig


def serve_configured(app: Any, config: ServerConfig, draining: Draining | None) -> None:
    """:func:`run_server` with ``config``'s address, TLS, connection limits, logging and
    drain (``infer serve``, one process or a fleet's ingress)."""
    http, observability = config.http, config.observability
    run_server(
        app,
        http.host,
        http.port,
        config.connections,
        log_level=observability.log_level,
        access_log=observability.uvicorn_access_log,
        draining=draining,
        drain_timeout_s=http.drain_timeout,
        **http.uvicorn_tls(),
    )
