"""Structured outputs by constrained decoding, over llguidance: the ``GrammarCompiler`` port
(:class:`LLGuidanceCompiler`) and the torch runner's per-request matchers
(:class:`RequestMatchers`)."""

from adapters.grammar.compiler import LLGuidanceCompiler
from adapters.grammar.matchers import RequestMatchers

__all__ = ["LLGuidanceCompiler", "RequestMatchers"]
