"""Composition root, CLI and in-process API."""
