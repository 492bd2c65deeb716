"""Observability adapters: Prometheus metrics over the engine's step statistics and the
HTTP faces' request records."""
