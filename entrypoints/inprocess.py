"""The engine embedded in a Python program, no HTTP.

    from entrypoints.inprocess import LLM
    from domain.sampling import SamplingParams

    llm = LLM()                                   # default model; LLM("gemma-3-270m"), ...
    for r in llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16)):
        print(r.text, r.finish_reason)

    async for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(delta, end="", flush=True)

Both run the engine loop (:class:`AsyncEngine`) as an asyncio task: ``generate`` while its
prompts run, batched by the engine's scheduler (continuous batching by default), returning
when all are done; ``stream`` while any stream is read, yielding text deltas as they are
produced.
"""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from adapters.torch.cpu.threads import set_threads
from application.engine.async_engine import AsyncEngine
from application.engine.request_ids import new_request_id
from domain.config import EngineConfig
from domain.errors import QueueFullError
from domain.request import AdmitCall, StepOutput
from domain.sampling import SamplingParams
from entrypoints.config import ServerConfig
from entrypoints.container import create_container

T = TypeVar("T")


@dataclass(frozen=True)
class GenerateResult:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    # each token's logprob, where ``SamplingParams.logprobs`` asked for them
    logprobs: list[float] | None = None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        engine: EngineConfig | None = None,
        cache_dir: str | None = None,
        quantization: str | None = None,
        threads: int | None = None,
    ) -> None:
        """``threads``: intra-op CPU threads (``--threads``); None leaves torch's setting."""
        if threads is not None:
            set_threads(threads)
        config = ServerConfig.for_model(
            model,
            dtype=dtype,
            device=device,
            cache_dir=cache_dir,
            quantization=quantization,
            engine=engine or EngineConfig(max_model_len=2048),
        )
        self._container = create_container(config)
        self.model_name = self._container.backend.resolved_model().name
        self.tokenizer = self._container.backend.tokenizer()
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
        engine = self._container.async_engine()
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} params for {len(prompts)} prompts")
        if engine.healthy:
            raise RuntimeError("generate() while stream()s run: finish them first")
        outputs = _run(_generate(engine, list(zip(prompts, per_prompt, strict=True))))
        return [_result(p, o) for p, o in zip(prompts, outputs, strict=True)]

    async def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[str]:
        """Yield the text of one request as it is generated (the loop runs meanwhile)."""
        engine = self._container.async_engine()
        if self._streams == 0:  # one engine loop for all of this LLM's concurrent streams
            engine.start()
        self._streams += 1
        outputs: AsyncIterator[StepOutput] | None = None
        try:
            outputs = await engine.stream(new_request_id("llm"), prompt, params or SamplingParams())
            async for output in outputs:
                if output.error is not None:
                    raise RuntimeError(output.error)
                if output.text_delta:
                    yield output.text_delta
        finally:
            if isinstance(outputs, AsyncGenerator):
                await outputs.aclose()  # left early: the request is aborted now
            self._streams -= 1
            if self._streams == 0:
                await engine.idle()  # finished requests' runner state is released
                await engine.stop()


def _run(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to completion from synchronous code; called from a coroutine (a
    notebook, an async test), on a thread of its own, its event loop blocked meanwhile."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(1, thread_name_prefix="llm-generate") as pool:
        return pool.submit(asyncio.run, work).result()


async def _generate(
    engine: AsyncEngine, requests: Sequence[tuple[str | list[int], SamplingParams]]
) -> list[list[StepOutput]]:
    """Run prompts through the engine loop: every one is prepared (tokenized, validated:
    a bad one raises before any is queued), then each is queued as the waiting queue has
    room (when full, once a queued one finishes); every output, in prompt order."""
    outputs: list[list[StepOutput]] = [[] for _ in requests]
    request_ids = [new_request_id("llm") for _ in requests]

    async def collect(index: int, stream: AsyncIterator[StepOutput]) -> None:
        outputs[index] = [output async for output in stream]

    running: set[asyncio.Task[None]] = set()
    queued = 0
    engine.start()
    try:
        prepared = [(await engine.inputs.prepare(prompt, p), p) for prompt, p in requests]
        while queued < len(prepared) or running:
            while queued < len(prepared):
                prompt_ids, params = prepared[queued]
                try:
                    [stream] = engine.submit(AdmitCall.one(request_ids[queued], prompt_ids, params))
                except QueueFullError:
                    if not running:
                        raise
                    break
                running.add(asyncio.create_task(collect(queued, stream)))
                queued += 1
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        await engine.idle()  # the loop's next step releases the finished requests
    finally:
        for task in running:
            task.cancel()
        engine.abort(request_ids)
        await engine.stop()
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
        logprobs=[o.logprob for o in outputs if o.logprob is not None] or None,
    )
