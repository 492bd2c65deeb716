"""The engine's output stage: sampled tokens in, one ``StepOutput`` per token out.

It owns each running request's text state (:class:`TextStream`: incremental detokenizing
and stop strings) and formats logprobs, in one pass per step. Finishing is decided once:
the scheduler reports the token-level finish of each token (EOS, stop ids, length); a stop
string found here goes back to the scheduler (``finish``), whose policy ends the request.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from domain.ports import Tokenizer
from domain.request import Request, StepOutput
from domain.scheduler import RunnerOutput, SampledToken
from domain.text_stream import TextStream

# Ends requests whose text hit a stop string (the scheduler's ``finish_requests``).
Finish = Callable[[Iterable[str], str], object]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, TextStream] = {}

    def add(self, request: Request) -> None:
        """Start tracking a queued request's text."""
        params = request.sampling_params
        self._streams[request.request_id] = TextStream(
            self.tokenizer,
            request.prompt_token_ids,
            params.stop,
            include_stop=params.include_stop_str_in_output,
        )

    def discard(self, request_id: str) -> None:
        """Forget a request ended elsewhere (aborted, failed)."""
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[str]:
        """Ids of the requests tracked (queued or running)."""
        return iter(self._streams)

    def process(
        self, sampled: list[SampledToken], result: RunnerOutput, finish: Finish
    ) -> list[StepOutput]:
        """One output per sampled token, in order; requests that end are forgotten."""
        outputs = []
        for token in sampled:
            request = token.request
            request_id = request.request_id
            stream = self._streams[request_id]
            delta, hit = stream.push(
                token.token_id, stop_token=token.stop_token, last=token.finish_reason is not None
            )
            stop_reason: str | int | None = None
            if hit:
                stop_reason = stream.matched
                if request.is_done and request.finish_reason == "length":
                    request.finish("stop")  # the last token's text hit a stop string
                else:
                    finish([request_id], "stop")
            elif token.stop_token and token.finish_reason == "stop":
                stop_reason = token.token_id  # one of ``stop_token_ids``
            if request.is_done:
                del self._streams[request_id]
            outputs.append(_output(request, token.token_id, delta, result, stop_reason))
        return outputs


def _output(
    request: Request,
    token: int,
    delta: str,
    result: RunnerOutput,
    stop_reason: str | int | None = None,
) -> StepOutput:
    request_id = request.request_id
    top = result.top_logprobs.get(request_id)
    finished = request.is_done
    return StepOutput(
        request_id,
        token,
        delta,
        finished=finished,
        finish_reason=request.finish_reason,
        stop_reason=stop_reason if finished and request.finish_reason == "stop" else None,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=len(request.generated_token_ids),
        logprob=result.logprobs.get(request_id),
        top_logprobs=tuple(top) if top else None,
        **_prompt_scores(request),
    )


def _prompt_scores(request: Request) -> dict[str, Any]:
    """The prompt's logprobs (and alternatives, target logprobs, draws), on a request's
    first output only."""
    params = request.sampling_params
    if not params.prompt_logprobs or len(request.generated_token_ids) != 1:
        return {}
    scores: dict[str, Any] = {"prompt_logprobs": tuple(request.prompt_logprobs)}
    if params.prompt_top_logprobs:
        scores["prompt_top_logprobs"] = tuple(tuple(r) for r in request.prompt_top_logprobs)
    if params.prompt_ranks:
        scores["prompt_ranks"] = tuple(request.prompt_ranks)
    if params.prompt_target_ids is not None:
        scores["prompt_target_logprobs"] = tuple(tuple(r) for r in request.prompt_target_logprobs)
    if params.prompt_samples:
        scores["prompt_samples"] = tuple(tuple(r) for r in request.prompt_samples)
    return scores
