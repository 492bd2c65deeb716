"""Observability adapters: Prometheus metrics, OpenTelemetry traces and structured logs,
fed by the engine's step statistics (the observer port) and by each API request's record."""
