"""A deterministic fake ModelRunner: no model, configurable latency, scripted tokens.

Each sampling request gets ``script(request)``: by default the token after its newest
one (``(last + 1) % vocab_size``), which makes outputs easy to predict in tests.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from domain.ports import Tokenizer
from domain.request import Request
from domain.scheduler import RunnerOutput, SchedulerOutput


def next_token(vocab_size: int) -> Callable[[Request], int]:
    def script(request: Request) -> int:
        last = (request.prompt_token_ids + request.generated_token_ids)[-1]
        return (last + 1) % vocab_size

    return script


class FakeModelRunner:
    def __init__(
        self,
        vocab_size: int = 259,
        *,
        script: Callable[[Request], int] | None = None,
        step_latency_s: float = 0.0,
        block_size: int = 16,
    ) -> None:
        self.script = script or next_token(vocab_size)
        self.step_latency_s = step_latency_s
        self.block_size = block_size
        self.live: set[str] = set()  # requests holding runner state (a generator)
        self.steps: list[SchedulerOutput] = []

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        self.steps.append(batch)
        written: dict[int, str] = {}  # block -> the request writing into it this step
        for chunk in batch.chunks:  # as the torch runner needs them: tables cover the chunk
            end, size = chunk.start + chunk.num_rows, self.block_size
            if len(chunk.block_table) * size < end:
                raise RuntimeError(
                    f"{chunk.request.request_id}: no KV block for position {end - 1}"
                )
            for block in chunk.block_table[chunk.start // size : -(-end // size)]:
                if written.setdefault(block, chunk.request.request_id) != chunk.request.request_id:
                    raise RuntimeError(f"block {block} written by two requests in one step")
        self.live.update(c.request.request_id for c in batch.chunks)
        tokens, accepted = {}, {}
        for chunk in batch.chunks:
            if not chunk.samples:
                continue
            rid = chunk.request.request_id
            if chunk.drafts:  # verified as the torch runner does: each row's own token
                accepted[rid], tokens[rid] = self._verify(chunk.request, chunk.drafts)
            else:
                tokens[rid] = self.script(chunk.request)
        return RunnerOutput(sampled_token_ids=tokens, accepted=accepted)

    def _verify(self, request: Request, drafts: Sequence[int]) -> tuple[list[int], int]:
        """The drafts the script agrees with, and its token after them."""
        generated = list(request.generated_token_ids)
        for i, draft in enumerate(drafts):
            token = self.script(replace(request, generated_token_ids=[*generated, *drafts[:i]]))
            if token != draft:
                return list(drafts[:i]), token
        return list(drafts), self.script(
            replace(request, generated_token_ids=[*generated, *drafts])
        )

    def release(self, request_ids: Sequence[str]) -> None:
        self.live.difference_update(request_ids)


def reply_script(
    tokenizer: Tokenizer, text: str, *, then_eos: bool = True
) -> Callable[[Request], int]:
    """Every request answers ``text`` token by token (then EOS), whatever its prompt."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if then_eos:
        tokens.append(min(tokenizer.eos_token_ids))

    def script(request: Request) -> int:
        return tokens[min(len(request.generated_token_ids), len(tokens) - 1)]

    return script
