"""A deterministic embedder: bytes as tokens, vectors from the tokens' counts."""

import math
from collections.abc import Sequence

CLS_ID, SEP_ID = 256, 257  # ids 0-255 are the UTF-8 bytes


class FakeEmbedder:
    """The Embedder port with one token per UTF-8 byte between ``[CLS]`` and ``[SEP]``
    (truncated as a BERT tokenizer truncates: the end is cut, ``[SEP]`` kept). A vector is
    the normalized count of each id modulo ``dimensions`` plus one, so equal inputs embed
    equally, and an input's vector does not depend on its batch. ``calls`` records each
    ``embed`` call's inputs (to see what was batched together)."""

    def __init__(self, dimensions: int = 8, max_tokens: int = 16) -> None:
        self._dimensions, self._max_tokens = dimensions, max_tokens
        self.calls: list[list[list[int]]] = []

    @property
    def dimensions(self) -> int:
        return self._dimensions

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def vocab_size(self) -> int:
        return SEP_ID + 1

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        body = self._max_tokens - 2
        return [[CLS_ID, *list(text.encode())[:body], SEP_ID] for text in texts]

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        self.calls.append([list(ids) for ids in inputs])
        return [self._vector(ids) for ids in inputs]

    def _vector(self, ids: Sequence[int]) -> list[float]:
        counts = [1.0] * self._dimensions
        for token in ids:
            counts[token % self._dimensions] += 1.0
        norm = math.sqrt(sum(c * c for c in counts))
        return [c / norm for c in counts]
