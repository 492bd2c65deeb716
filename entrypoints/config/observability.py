"""``infer serve`` flags for logs, metrics and traces."""

import argparse

from adapters.observability.logging import FORMATS, LEVELS
from adapters.observability.settings import ObservabilitySettings
from adapters.observability.tracing import PROTOCOLS, TracingSettings
from domain.errors import InvalidParameterError


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logs, metrics and traces")
    group.add_argument("--log-level", default="info", choices=LEVELS, help="(default %(default)s)")
    group.add_argument(
        "--log-format",
        default="auto",
        choices=FORMATS,
        help="json: one JSON object per line; console: for a terminal; auto: console on a "
        "TTY, else json (default %(default)s)",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no canonical log line per API request",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no uvicorn access line per request (the canonical line has more)",
    )
    group.add_argument(
        "--disable-metrics", action="store_true", help="do not serve Prometheus /metrics"
    )
    group.add_argument(
        "--max-tenant-labels",
        type=int,
        default=100,
        help="distinct tenant label values in metrics; later tenants count as 'other' "
        "(default %(default)s)",
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry traces to this OTLP receiver: http://HOST:4318 "
        "(OTLP/HTTP, e.g. Jaeger) or grpc://HOST:4317; default: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, else no traces",
    )
    group.add_argument(
        "--otlp-traces-protocol",
        default=None,
        choices=PROTOCOLS,
        help="default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, "
        "else http/protobuf (grpc:// endpoints use grpc)",
    )
    group.add_argument(
        "--trace-console", action="store_true", help="also print every span (debugging)"
    )


def from_args(args: argparse.Namespace) -> ObservabilitySettings:
    """``infer serve``'s settings (a bad protocol variable fails now, before the model
    loads)."""
    if args.max_tenant_labels < 1:
        raise InvalidParameterError("max_tenant_labels", "must be at least 1")
    tracing = TracingSettings(
        endpoint=args.otlp_traces_endpoint,
        protocol=args.otlp_traces_protocol,
        console=args.trace_console,
    )
    try:
        tracing.resolved_protocol()  # a bad protocol variable fails at start-up
    except ValueError as e:
        raise InvalidParameterError("otlp_traces_protocol", str(e)) from e
    return ObservabilitySettings(
        metrics=not args.disable_metrics,
        tracing=tracing,
        log_requests=not args.disable_log_requests,
        max_tenant_labels=args.max_tenant_labels,
        log_level=args.log_level,
        log_format=args.log_format,
        uvicorn_access_log=not args.disable_uvicorn_access_log,
    )
