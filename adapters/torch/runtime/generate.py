"""Single-request generation with the KV cache: a streaming iterator of text deltas.

The engine (batching, many requests) has its own loop; this is the standalone path for
scripts, the CLI and the benchmark baseline.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from adapters.torch.models.kv_cache import KVCache
from adapters.torch.models.transformer import Transformer
from adapters.torch.runtime.logits import process_logits
from adapters.torch.runtime.sampler import TokenSampler, make_generator
from domain.errors import InvalidParameterError
from domain.ports import Tokenizer
from domain.request import is_stop_token, token_finish_reason
from domain.sampling import SamplingParams
from domain.text_stream import TextStream


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
    device = model.embed_tokens.weight.device
    sampler = sampler or TokenSampler()
    generator = make_generator(params.seed, device) if params.seed is not None else None
    cache = KVCache.from_model_config(
        model.config,
        len(prompt_ids) + params.max_tokens,
        dtype=model.embed_tokens.weight.dtype,
        device=device,
    )
    eos = tokenizer.eos_token_ids
    text = TextStream(tokenizer, prompt_ids, params.stop)
    output: list[int] = []
    next_input = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids], device=device), kv_cache=cache)
        while True:
            raw = logits[:, -1]
            sampled = sampler.sample(
                process_logits(raw, [params]),
                [params],
                prompt_ids=[prompt_ids],
                output_ids=[output],
                generators=[generator],
                raw_logits=raw,
            )
            token = sampled.token_ids[0]
            output.append(token)
            reason = token_finish_reason(params, eos, token, len(output))
            delta, hit = text.push(
                token, stop_token=is_stop_token(params, eos, token), last=reason is not None
            )
            yield GenerationChunk(
                delta,
                token,
                sampled.logprobs[0] if sampled.logprobs else None,
                sampled.top_logprobs[0] if sampled.top_logprobs else [],
                "stop" if hit else reason,
            )
            if hit or reason is not None:
                return
            next_input.fill_(token)
            logits = model(next_input, kv_cache=cache)


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
