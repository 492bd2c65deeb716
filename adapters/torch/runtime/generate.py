"""Single-request generation as one engine request: a streaming iterator of text deltas.

:func:`stream_generate` builds a small engine (:class:`~application.engine.engine.Engine` over a
:class:`TorchModelRunner`: one request, a KV pool of its length) for each call and steps it
until the request ends, so a script, a test or a benchmark baseline gets exactly what the
engine serves (same paged KV, kernels, sampling and stop rules), with no event loop.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from adapters.torch.models.transformer import Transformer
from adapters.torch.runtime.runner import TorchModelRunner
from adapters.torch.runtime.sampler import TokenSampler
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.ports import Tokenizer
from domain.request import AdmitCall, StepOutput
from domain.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationChunk:
    """One sampled token's worth of output; the last chunk carries ``finish_reason``
    (``"eos"``, ``"stop"`` or ``"length"``). ``text`` may be empty while text is held back
    (an unfinished UTF-8 character or a possible stop-string prefix)."""

    text: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class _Outputs(list[StepOutput]):
    """The engine's output sink: the step's outputs, read and cleared by the caller."""

    def publish(self, output: StepOutput) -> None:
        self.append(output)


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    sampler: TokenSampler | None = None,
) -> Iterator[GenerationChunk]:
    """Yield a chunk per generated token until EOS, a stop string / token, or max tokens."""
    _validate(model, tokenizer, prompt_ids, params)
    config = EngineConfig(
        max_model_len=len(prompt_ids) + params.max_tokens,
        max_num_seqs=1,
        prefix_caching=False,
        # a runner per call: capturing CUDA graphs for one request would cost more than
        # they save
        enforce_eager=True,
    )
    outputs = _Outputs()
    engine = Engine(
        config,
        TorchModelRunner(model, config, sampler),
        tokenizer,
        outputs,
        vocab_size=model.config.vocab_size,
    )
    engine.admit(AdmitCall.one("generate", prompt_ids, params))
    while engine.has_work():
        engine.step()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(output.error)
            if output.token_id is None:
                continue
            yield GenerationChunk(
                output.text_delta,
                output.token_id,
                output.logprob,
                list(output.top_logprobs or ()),
                output.finish_reason,
            )
            if output.finished:
                return
        outputs.clear()


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    chat: bool = False,
) -> GenerationResult:
    """Run :func:`stream_generate` to completion; ``chat`` renders ``prompt`` as a user turn."""
    prompt_ids = encode_prompt(tokenizer, prompt, chat=chat)
    chunks = list(stream_generate(model, tokenizer, prompt_ids, params))
    return GenerationResult(
        text="".join(c.text for c in chunks),
        token_ids=[c.token_id for c in chunks],
        finish_reason=chunks[-1].finish_reason or "length",
        prompt_tokens=len(prompt_ids),
    )


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int], *, chat: bool) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if chat:
        return tokenizer.render_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def _validate(
    model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams
) -> None:
    if not prompt_ids:
        raise InvalidParameterError("prompt", "must not be empty")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab})")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidParameterError(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length {limit}",
        )
