"""Litestar HTTP adapter: the native token stream (seed 000 §7), the OpenAI endpoints, health."""

from adapters.http.app import create_app

__all__ = ["create_app"]
