"""The engine: one synchronous step at a time — schedule, run, apply, publish.

``step()`` never blocks on I/O; output leaves through the OutputSink port. Text deltas and
stop strings are handled here (they need the tokenizer); token-level stops (EOS, stop ids,
length) are the scheduler's.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from domain.config import EngineConfig
from domain.detokenizer import IncrementalDetokenizer
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)
from domain.ports import ModelRunner, OutputSink, Tokenizer
from domain.request import Request, StepOutput
from domain.sampling import SamplingParams
from domain.scheduler import Scheduler, SchedulerOutput, make_scheduler
from domain.stop import StopStringMatcher

log = structlog.get_logger(__name__)


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        sink: OutputSink,
        *,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the model's, when it differs from the tokenizer's (token-id
        prompts are checked against it: an id past the embedding would fail the whole step)."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.sink = sink
        self.scheduler = scheduler or make_scheduler(config, tokenizer.eos_token_ids)
        self.clock = clock
        self._text: dict[str, _TextState] = {}
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, validated (empty, out-of-vocabulary ids, too long for
        ``max_seq_len`` with ``params``): what :meth:`add_request` checks, queueing nothing."""
        if not prompt:  # checked before tokenizing: a BOS token would hide an empty string
            raise EmptyPromptError()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(
                "prompt", f"token id {bad} is out of vocabulary (ids are 0..{self.vocab_size - 1})"
            )
        if len(prompt_ids) + params.max_new_tokens > self.config.max_seq_len:
            raise PromptTooLongError(
                len(prompt_ids), params.max_new_tokens, self.config.max_seq_len
            )
        return prompt_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
    ) -> Request:
        """Validate, tokenize and queue a request; raises before anything is queued
        (``QueueFullError`` when the waiting queue is at ``max_waiting_requests``).
        ``adapter_id``: a LoRA adapter the runner holds, applied to this request only."""
        prompt_ids = self.prepare(prompt, params)
        request = Request(request_id, prompt_ids, params, self.clock(), adapter_id=adapter_id)
        if not self.scheduler.add_request(request):
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests})")
        self._text[request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, prompt_ids), StopStringMatcher(params.stop)
        )
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request now; its runner state is released at the next step."""
        if self.scheduler.abort(request_id) is not None:
            self._text.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> bool:
        """One scheduler iteration; False when there was nothing to run (idle, or a static
        batch still waiting to fill)."""
        batch = self.scheduler.schedule()
        if batch.released:
            self.runner.release(batch.released)
        if batch.is_empty:
            return False
        try:
            result = self.runner.execute(batch)
        except Exception as e:  # a failed forward fails its batch, never the engine
            self._fail(batch, f"{type(e).__name__}: {e}")
            return True
        for request in self.scheduler.update_from_output(batch, result):
            rid = request.request_id
            top = result.top_logprobs.get(rid)
            self.sink.publish(self._output(request, result.logprobs.get(rid), top))
        return True

    def _output(
        self,
        request: Request,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> StepOutput:
        token = request.generated_token_ids[-1]
        text = self._text[request.request_id]
        if request.finish_reason in ("eos", "stop") and token in self._stop_ids(request):
            delta = self._flush(text)  # the stop token itself is not text
        else:
            delta, hit = text.stops.feed(text.detokenizer.push(token))
            if hit:
                request.finish("stop")
            elif request.is_done:
                delta += self._flush(text)
        if request.is_done:
            del self._text[request.request_id]
        return StepOutput(
            request.request_id,
            token,
            delta,
            finished=request.is_done,
            finish_reason=request.finish_reason,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=len(request.generated_token_ids),
            logprob=logprob,
            top_logprobs=tuple(top_logprobs) if top_logprobs else None,
            **self._prompt_scores(request),
        )

    @staticmethod
    def _prompt_scores(request: Request) -> dict[str, Any]:
        """The prompt's logprobs (and alternatives), on a request's first output only."""
        params = request.sampling_params
        if not params.prompt_logprobs or len(request.generated_token_ids) != 1:
            return {}
        scores: dict[str, Any] = {"prompt_logprobs": tuple(request.prompt_logprobs)}
        if params.prompt_top_logprobs:
            scores["prompt_top_logprobs"] = tuple(tuple(r) for r in request.prompt_top_logprobs)
        return scores

    def _stop_ids(self, request: Request) -> frozenset[int]:
        eos = frozenset() if request.sampling_params.ignore_eos else self.tokenizer.eos_token_ids
        return eos | frozenset(request.sampling_params.stop_token_ids)

    @staticmethod
    def _flush(text: _TextState) -> str:
        tail, _ = text.stops.feed(text.detokenizer.flush())
        return tail + text.stops.flush()

    def _fail(self, batch: SchedulerOutput, error: str) -> None:
        log.error("engine step failed", error=error, requests=len(batch.chunks))
        failed = [c.request for c in batch.chunks]
        for request in failed:
            request.fail(error)
            self._text.pop(request.request_id, None)
            self.sink.publish(StepOutput(request.request_id, None, "", finished=True, error=error))
        self.runner.release([r.request_id for r in failed])
