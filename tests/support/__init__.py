"""Helpers that more than one test module imports: tiny models, GGUF files, a paged
forward, a Tinker server and its raw-HTTP client (fixtures live in each folder's conftest)."""
