"""Litestar HTTP adapter: the native token stream, the OpenAI endpoints, the
Tinker fine-tuning API and health, over an engine client and a Tinker service."""

from adapters.http.app import HttpServices, HttpSettings, create_app

__all__ = ["HttpServices", "HttpSettings", "create_app"]
