"""The engine: one synchronous step at a time — schedule, run, apply, publish.

``step()`` never blocks on I/O; output leaves through the OutputSink port. Text deltas and
stop strings are handled here (they need the tokenizer); token-level stops (EOS, stop ids,
length) are the scheduler's.
"""

import time
from collections.abc import Callable, Iterable, Sequence
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
# What a client is told when a step fails (a bug or the device, not its request).
STEP_FAILED = "internal error: the engine step failed (details in the server log)"


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

    def check_params(self, params: SamplingParams) -> None:
        """The server's limits on ``stop`` and ``stop_token_ids`` (a 400 naming the field)."""
        limit = self.config.max_stop_strings
        for name, values in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids)):
            if len(values) > limit:
                raise InvalidParameterError(name, f"{len(values)} entries, more than {limit}")
        size = sum(map(_utf8_size, params.stop))
        if size > self.config.max_stop_bytes:
            raise InvalidParameterError(
                "stop", f"{size} bytes in all, more than {self.config.max_stop_bytes}"
            )

    def check_prompt_size(self, texts: Iterable[str], param: str = "prompt") -> None:
        """``texts`` (one prompt, or a chat's messages) are at most ``max_prompt_bytes`` of
        UTF-8 together: checked before tokenizing, which costs time in proportion."""
        limit, size = self.config.max_prompt_bytes, 0
        for text in texts:
            size += len(text) if len(text) > limit else _utf8_size(text)
            if size > limit:
                raise InvalidParameterError(param, f"larger than the limit of {limit} bytes")

    def check_room(self, count: int) -> None:
        """``count`` requests can be queued together now: ``InvalidParameterError`` when
        they never can (beyond ``max_prompts_per_request`` or the engine's capacity),
        ``QueueFullError`` when not now. Cheap: callers check before tokenizing."""
        limit = min(self.config.max_prompts_per_request, self.config.capacity)
        if count > limit:
            raise InvalidParameterError(
                "prompt", f"{count} prompts in one request; at most {limit} fit"
            )
        if count > self.scheduler.room():
            raise QueueFullError(
                f"the engine is full ({self.config.max_batch_size} running and "
                f"{self.config.max_waiting_requests} waiting at most); retry later"
            )

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, validated (empty, too large, out-of-vocabulary ids, too
        long for ``max_seq_len`` with ``params``, the server's limits on ``params``): what
        :meth:`add_request` checks, queueing nothing. Touches no engine state, so it may
        run on another thread than the step loop."""
        if not prompt:  # checked before tokenizing: a BOS token would hide an empty string
            raise EmptyPromptError()
        self.check_params(params)
        if isinstance(prompt, str):
            self.check_prompt_size([prompt])
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if len(prompt_ids) + params.max_tokens > self.config.max_seq_len:
            raise PromptTooLongError(len(prompt_ids), params.max_tokens, self.config.max_seq_len)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(
                "prompt", f"token id {bad} is out of vocabulary (ids are 0..{self.vocab_size - 1})"
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
        (``QueueFullError`` when the engine is full). ``adapter_id``: a LoRA adapter the
        runner holds, applied to this request only."""
        prompt_ids = self.prepare(prompt, params)
        return self.admit([request_id], [prompt_ids], params, adapter_id=adapter_id)[0]

    def admit(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
    ) -> list[Request]:
        """Queue prepared prompts (:meth:`prepare`'s ids) all together or none: raises what
        :meth:`check_room` raises, with nothing queued."""
        self.check_room(len(request_ids))
        now = self.clock()
        requests = [
            Request(request_id, prompt_ids, params, now, adapter_id=adapter_id)
            for request_id, prompt_ids in zip(request_ids, prompts, strict=True)
        ]
        for request in requests:
            self.scheduler.add_request(request)  # room was checked for all of them
            self._text[request.request_id] = _TextState(
                IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
                StopStringMatcher(params.stop),
            )
        return requests

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
        except Exception:  # a failed forward fails its batch, never the engine
            # Clients get no exception text (it can name files and internals); the log has it.
            log.exception("engine step failed", requests=len(batch.chunks))
            self._fail(batch, STEP_FAILED)
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
        failed = [c.request for c in batch.chunks]
        for request in failed:
            request.fail(error)
            self._text.pop(request.request_id, None)
            self.sink.publish(StepOutput(request.request_id, None, "", finished=True, error=error))
        self.runner.release([r.request_id for r in failed])


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
