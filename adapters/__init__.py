"""Driven and driving adapters: torch models, tokenizers, weight sources, HTTP, telemetry."""
