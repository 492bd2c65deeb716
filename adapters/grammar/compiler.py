"""LLGuidanceCompiler: structured-output constraints -> llguidance grammars for one tokenizer.

It implements the ``GrammarCompiler`` port (the engine checks each request's constraint
when it is prepared) and hands the runner's matchers a fresh matcher per request. A
compiled matcher is kept per distinct constraint (the most recent ``CACHE_SIZE``), and each
request gets a copy: a schema compiles once however many requests use it.

JSON comes out in one layout (``", "`` and ``": "`` between items, no other whitespace):
free whitespace would let a small model pad its answer with newlines until ``max_tokens``.
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import llguidance
from llguidance import LLMatcher

from domain.errors import InvalidParameterError
from domain.ports import STRUCTURED_PARAM
from domain.sampling import StructuredOutput

CACHE_SIZE = 64
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceCompiler:
    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self._compiled: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # prepare threads check, the runner's worker copies

    @classmethod
    def from_tokenizer_json(
        cls, path: Path, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> "LLGuidanceCompiler":
        """Over a Hugging Face ``tokenizer.json`` (about 0.3 s for a 49k vocabulary);
        ``vocab_size``: the model's (its logits' width), which may exceed the tokenizer's."""
        tokenizer = llguidance.LLTokenizer(
            path.read_text(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        return cls(tokenizer)

    @classmethod
    def from_token_bytes(
        cls, tokens: Sequence[bytes], special_ids: Iterable[int], eos_token_ids: Iterable[int]
    ) -> "LLGuidanceCompiler":
        """Over a vocabulary given as each id's bytes (``special_ids``: control tokens,
        never allowed by a grammar, EOS excepted)."""
        eos = sorted(eos_token_ids)
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(list(tokens), list(special_ids), eos[0]))
        return cls(llguidance.LLTokenizer(wrapper, eos_token=eos))

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def check(self, structured: StructuredOutput) -> None:
        self._template(structured)

    def matcher(self, structured: StructuredOutput) -> LLMatcher:
        """A fresh matcher at the start of ``structured``'s grammar."""
        template = self._template(structured)
        with self._lock:  # a matcher is not to be used from two threads at once
            return template.deep_copy()

    def _template(self, structured: StructuredOutput) -> LLMatcher:
        with self._lock:
            if (cached := self._compiled.get(structured)) is not None:
                self._compiled.move_to_end(structured)
                return cached
        matcher = self._compile(structured)
        with self._lock:
            self._compiled[structured] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def _compile(self, structured: StructuredOutput) -> LLMatcher:
        what = _NAMES[structured.kind]
        try:
            grammar = grammar_text(structured)
        except ValueError as e:
            raise InvalidParameterError(STRUCTURED_PARAM, f"invalid {what}: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidParameterError(STRUCTURED_PARAM, f"invalid {what}: {error.strip()}")
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(STRUCTURED_PARAM, f"invalid {what}: {matcher.get_error()}")
        return matcher


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured``; ``ValueError`` when its spec is malformed.
    A ``grammar`` spec is Lark (llguidance's dialect) or GBNF (llama.cpp's)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = json.loads(spec)
        if not isinstance(schema, dict):
            raise ValueError("a schema is a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise ValueError("choices are a non-empty list of strings")
        return llguidance.grammar_from("choice", spec)
    if not spec.strip():
        raise ValueError("the grammar is empty")
    return llguidance.grammar_from("grammar", spec)


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokens: list[bytes], special_ids: list[int], eos: int) -> None:
        self.tokens, self.special_token_ids = tokens, special_ids
        self.eos_token_id, self.bos_token_id = eos, None
        special = set(special_ids)
        self._ids = {t: i for i, t in enumerate(tokens) if i not in special}

    def __call__(self, text: bytes) -> list[int]:
        """Greedy longest-match (llguidance only tokenizes to seed grammar forcing)."""
        ids, at = [], 0
        longest = max(map(len, self._ids))
        while at < len(text):
            for size in range(min(longest, len(text) - at), 0, -1):
                if (token := self._ids.get(text[at : at + size])) is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                raise ValueError(f"byte {text[at]} has no token")
        return ids
