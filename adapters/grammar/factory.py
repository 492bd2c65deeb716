"""What the composition root builds from the grammar adapter: the structured outputs'
compiler over a model's vocabulary, from its ``tokenizer.json`` or from each id's bytes."""

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from adapters.grammar.compiler import LLGuidanceCompiler


class ByteVocabulary(Protocol):
    """A tokenizer that lists each id's bytes (the byte tokenizer of dummy-weight models)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def special_ids(self) -> Sequence[int]: ...
    def token_bytes(self) -> list[bytes]: ...


def tokenizer_json_grammar(
    folder: Path, vocab_size: int, eos_token_ids: Iterable[int]
) -> LLGuidanceCompiler:
    """Structured outputs over the model folder's ``tokenizer.json``."""
    return LLGuidanceCompiler.from_tokenizer_json(
        folder / "tokenizer.json", vocab_size, eos_token_ids
    )


def byte_grammar(tokenizer: ByteVocabulary, vocab_size: int) -> LLGuidanceCompiler:
    """Structured outputs over ``tokenizer``'s bytes for a model of ``vocab_size`` ids
    (the ids past the tokenizer's are never allowed)."""
    tokens = tokenizer.token_bytes()
    unused = range(len(tokens), vocab_size)
    return LLGuidanceCompiler.from_token_bytes(
        tokens + [b"<unused%d>" % i for i in unused],
        special_ids=[*tokenizer.special_ids, *unused],
        eos_token_ids=tokenizer.eos_token_ids,
    )
