"""Structured logs, configured once for the process: structlog and the standard library
(uvicorn's access and error logs, third-party libraries) through one pipeline.

``json``: one JSON object per line (``timestamp``, ``level``, ``logger``, ``event`` and the
fields); ``console``: coloured key=value lines for a terminal; ``auto``: console on a TTY,
else JSON. Every line written while an API request is served carries its ``request_id``
and, with tracing on, the ``trace_id`` / ``span_id`` of the current span.
"""

import logging
import sys
from typing import Any, TextIO

import structlog
from opentelemetry import trace

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("auto", "json", "console")
# Loggers that configure handlers of their own: their records go to the root's instead.
_OWN_HANDLERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """The current span's trace and span ids (W3C hex), when a span is recording."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a redirected or
    captured stream included), as the standard library's last-resort handler does."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        pass


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> str:
    """Route structlog and standard-library logging to ``stream`` (default: standard error,
    never standard output, which is the CLI's product) at ``level`` as ``fmt``; returns the
    format used (``auto`` resolved). Until this runs, structlog prints to standard output:
    an entry point calls it before anything logs."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    if fmt == "auto":
        fmt = "console" if handler.stream.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_ids,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=handler.stream.isatty())
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _OWN_HANDLERS:
        own = logging.getLogger(name)
        own.handlers.clear()
        own.propagate = True
    return fmt
