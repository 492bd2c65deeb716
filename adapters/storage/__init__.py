"""Durable storage adapters (checkpoints on the local filesystem)."""
