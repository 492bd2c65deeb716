"""Grammar masks for the torch runner's structured-output rows, off the critical path.

A step's grammar rows get their next-token bitmasks computed on a worker thread while the
forward runs (the matchers release the GIL); the runner joins before sampling and the
masks are applied in :func:`adapters.torch.runtime.logits.process_logits`. The matchers
themselves live behind :class:`GrammarMatchers` (``adapters/grammar`` implements it).
"""

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from domain.request import Request
from domain.sampling import StructuredOutput


class GrammarMatchers(Protocol):
    """One grammar matcher per running structured-output request."""

    @property
    def vocab_size(self) -> int: ...

    def fill(
        self, rows: Sequence[tuple[str, StructuredOutput, Sequence[int]]], bitmask: Tensor
    ) -> None:
        """Row ``i`` of ``bitmask`` (int32 ``[len(rows), ceil(vocab / 32)]``): the tokens
        ``rows[i]`` (request id, constraint, tokens generated so far) may take next; a
        request met for the first time starts a matcher that consumes those tokens. A
        request's later rows in the same call (speculative drafts) carry its tokens and
        the drafts before them: their masks are those of a copy of its matcher that
        consumed the drafts (its own matcher does not move)."""
        ...

    def advance(self, request_id: str, token_id: int) -> None: ...

    def release(self, request_id: str) -> None: ...


@dataclass
class GrammarMasks:
    """A step's masks: ``rows`` (indices into the step's sampled rows) and, once
    computed, their ``bitmask``."""

    rows: list[int]
    bitmask: Tensor
    done: Future[None]

    def result(self) -> Tensor:
        self.done.result()  # re-raises what failed on the worker
        return self.bitmask


class GrammarStep:
    def __init__(self, matchers: GrammarMatchers) -> None:
        self.matchers = matchers
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def begin(
        self, requests: Sequence[Request], drafted: Sequence[Sequence[int]] = ()
    ) -> GrammarMasks | None:
        """Start the masks of ``requests`` (the step's sampled rows, in order) that have a
        structured-output constraint; None when none has. ``drafted``: per row, the
        drafts before it (a drafted chunk's rows: its request once per draft, after its
        own row)."""
        rows, grammar_rows = [], []
        for i, request in enumerate(requests):
            structured = request.sampling_params.structured
            if structured is None:
                continue
            before = drafted[i] if drafted else ()
            tokens = [*request.generated_token_ids, *before] if before else None
            generated = structured.constrained_tokens(
                request.generated_token_ids if tokens is None else tokens
            )
            if generated is None:  # still before the constraint starts (thinking)
                continue
            rows.append(i)
            grammar_rows.append((request.request_id, structured, generated))
        if not rows:
            return None
        words = (self.matchers.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        done = self._worker.submit(self.matchers.fill, grammar_rows, bitmask)
        return GrammarMasks(rows, bitmask, done)

    def advance(
        self, sampled: Mapping[str, int], accepted: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """The step's tokens: each request's ``accepted`` drafts, then its sampled token."""
        for request_id, token_id in sampled.items():
            for draft in (accepted or {}).get(request_id, ()):
                self.matchers.advance(request_id, draft)
            self.matchers.advance(request_id, token_id)

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.matchers.release(request_id)


@contextmanager
def joined(masks: GrammarMasks | None) -> Iterator[None]:
    """Waits for the worker on the way out, whatever happened (a failed forward must not
    leave it touching matchers that the engine then releases)."""
    try:
        yield
    finally:
        if masks is not None:
            masks.done.exception()  # waits; a failure is raised where the masks are used
