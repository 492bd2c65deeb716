"""Fakes of the domain ports: deterministic, dependency-free, held to the same contract tests."""

from adapters.fake.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer"]
