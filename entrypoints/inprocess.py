"""The engine embedded in a Python program, no HTTP.

    from entrypoints.inprocess import LLM
    from domain.sampling import SamplingParams

    llm = LLM()                                   # default model; LLM("gemma-3-270m"), ...
    for r in llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16)):
        print(r.text, r.finish_reason)

    async for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(delta, end="", flush=True)

``generate`` batches the prompts through the engine's scheduler (continuous batching by
default) and returns when all are done; ``stream`` runs the engine loop as an asyncio task
for one request and yields text deltas as they are produced.
"""

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from application.request_ids import new_request_id
from domain.config import EngineConfig
from domain.errors import QueueFullError
from domain.request import StepOutput
from domain.sampling import SamplingParams
from entrypoints.container import create_container


@dataclass(frozen=True)
class GenerateResult:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "bfloat16",
        device: str | None = None,
        engine: EngineConfig | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self._container = create_container(
            model,
            dtype=dtype,
            device=device,
            cache_dir=cache_dir,
            engine=engine or EngineConfig(max_seq_len=2048),
        )
        self.model_name = self._container.resolved_model().name
        self.tokenizer = self._container.tokenizer()
        self._streams = 0  # stream() calls running now

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Run every prompt to completion, batched; results in prompt order.

        ``params``: one for every prompt, or one per prompt (as vLLM's ``generate``). Every
        prompt is validated before any runs (a bad one raises, nothing queued); any number
        of prompts: they enter the engine's waiting queue as it has room."""
        engine, sink = self._container.engine(), self._container.sink()
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} params for {len(prompts)} prompts")
        pending = deque(
            (new_request_id("llm"), engine.prepare(prompt, p), p)
            for prompt, p in zip(prompts, per_prompt, strict=True)
        )
        ids = [request_id for request_id, _, _ in pending]
        queues = [sink.open(request_id) for request_id in ids]
        try:
            while pending or engine.has_work():
                while pending:
                    try:
                        engine.add_request(*pending[0])
                    except QueueFullError:
                        break  # the next step admits waiting requests and makes room
                    pending.popleft()
                engine.step()
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        finally:
            for request_id in ids:
                sink.close(request_id)
        engine.step()  # release the last finished requests' runner state
        return [_result(p, _drain(q)) for p, q in zip(prompts, queues, strict=True)]

    async def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[str]:
        """Yield the text of one request as it is generated (the loop runs meanwhile)."""
        engine = self._container.async_engine()
        if self._streams == 0:  # one engine loop for all of this LLM's concurrent streams
            engine.start()
        self._streams += 1
        try:
            outputs = await engine.stream(new_request_id("llm"), prompt, params or SamplingParams())
            async for output in outputs:
                if output.error is not None:
                    raise RuntimeError(output.error)
                if output.text_delta:
                    yield output.text_delta
        finally:
            self._streams -= 1
            if self._streams == 0:
                await engine.stop()


def _drain(queue: "asyncio.Queue[StepOutput]") -> list[StepOutput]:
    outputs = []
    while not queue.empty():
        outputs.append(queue.get_nowait())
    return outputs


def _result(prompt: str | list[int], outputs: list[StepOutput]) -> GenerateResult:
    last = outputs[-1] if outputs else None
    if last is not None and last.error is not None:
        raise RuntimeError(last.error)
    return GenerateResult(
        prompt=prompt,
        text="".join(o.text_delta for o in outputs),
        token_ids=[o.token_id for o in outputs if o.token_id is not None],
        finish_reason=last.finish_reason if last else None,
        prompt_tokens=last.prompt_tokens if last else 0,
    )
