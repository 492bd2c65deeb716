"""RequestMatchers: one llguidance matcher per running structured-output request.

The torch runner asks for the next-token bitmasks of a step's grammar rows (on a worker
thread, while the forward runs), reports each sampled token, and releases a request when
it ends. Reported tokens are consumed at the next ``fill``, so that work is off the
critical path too. A request met for the first time gets a fresh matcher that consumes the
tokens it already generated: after a preemption by recompute it continues where it was.

When the grammar is complete only EOS is allowed, so the request ends; a matcher in an
error state (it cannot happen through the masks) allows only EOS too.
"""

from collections.abc import Sequence

import llguidance
import torch
from torch import Tensor

from adapters.grammar.compiler import LLGuidanceCompiler
from domain.sampling import StructuredOutput

# (request id, its constraint, the tokens it has generated so far)
GrammarRow = tuple[str, StructuredOutput, Sequence[int]]


class RequestMatchers:
    def __init__(self, compiler: LLGuidanceCompiler, threads: int | None = None) -> None:
        """``threads``: llguidance's mask threads (None: its default, most of the CPUs)."""
        self.compiler = compiler
        self._executor = llguidance.LLExecutor(threads)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._unconsumed: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return self.compiler.vocab_size

    def __len__(self) -> int:
        """Requests holding a matcher."""
        return len(self._matchers)

    def fill(self, rows: Sequence[GrammarRow], bitmask: Tensor) -> None:
        """Row ``i`` of ``bitmask`` (int32 ``[len(rows), ceil(vocab / 32)]``, on the CPU):
        the tokens ``rows[i]``'s grammar allows next, one bit each. Releases the GIL."""
        pairs = []
        base: dict[str, int] = {}  # request id -> its own row's token count, this call
        for index, (request_id, structured, generated) in enumerate(rows):
            if request_id in base:  # a draft's row: a copy that consumed the drafts
                draft = self._matchers[request_id].deep_copy()
                draft.consume_tokens(list(generated[base[request_id] :]))  # bad: EOS only
                pairs.append((draft, index))
                continue
            base[request_id] = len(generated)
            matcher = self._matchers.get(request_id)
            if matcher is None:
                matcher = self._matchers[request_id] = self.compiler.matcher(structured)
                tokens = list(generated)
            else:
                tokens = self._unconsumed.pop(request_id, [])
            if tokens:
                matcher.consume_tokens(tokens)  # on failure: an error state, EOS only
            pairs.append((matcher, index))
        # llguidance.torch's fill functions, inlined: importing that module compiles a
        # function with torch.compile, which imports torch._dynamo (~3 s of every start)
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if len(pairs) == 1:  # no thread pool round trip for one row
            pairs[0][0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )

    def advance(self, request_id: str, token_id: int) -> None:
        """``request_id`` sampled ``token_id`` (ignored for a request without a matcher)."""
        if request_id in self._matchers:
            self._unconsumed.setdefault(request_id, []).append(token_id)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._unconsumed.pop(request_id, None)
