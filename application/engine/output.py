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
            stream = self._streams.get(request_id)
            if stream is None:  # a stop string ended it at an earlier token of this step
                continue
            delta, hit = stream.push(
                token.token_id, stop_token=token.stop_token, last=token.finish_reason is not None
            )
            stop_reason: str | int | None = None
            if hit:
                stop_reason = stream.matched
                if request.is_done:  # by this token's (length) or a later draft's finish
                    request.finish("stop")
                else:
                    finish([request_id], "stop")
                # accepted drafts after the stop string are not the request's
                del request.generated_token_ids[token.index + 1 :]
            elif token.stop_token and token.finish_reason == "stop":
                stop_reason = token.token_id  # one of ``stop_token_ids``
            ended = hit or token.finish_reason is not None
            if ended:
                del self._streams[request_id]
            outputs.append(_output(request, token, delta, ended, stop_reason))
        return outputs


def _output(
    request: Request,
    token: SampledToken,
    delta: str,
    finished: bool,
    stop_reason: str | int | None = None,
) -> StepOutput:
    return StepOutput(
        request.request_id,
        token.token_id,
        delta,
        finished=finished,
        finish_reason=request.finish_reason if finished else None,
        stop_reason=stop_reason if finished and request.finish_reason == "stop" else None,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=token.index + 1,
        cached_tokens=request.num_cached_tokens or 0,
        logprob=token.logprob,
        top_logprobs=token.top_logprobs,
        **_prompt_scores(request, token.index),
    )


def _prompt_scores(request: Request, index: int) -> dict[str, Any]:
    """The prompt's logprobs (and alternatives, target logprobs, draws), on a request's
    first output only (its token ``index`` 0)."""
    params = request.sampling_params
    if not params.prompt_logprobs or index != 0:
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
