"""Sampling parameters: a validated value object shared by every face of the engine."""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from domain.errors import InvalidParameterError

MAX_LOGPROBS = 20
MAX_PROMPT_TARGETS = 64  # ids scored at one prompt position (``prompt_target_ids``)
MAX_CACHE_SALT = 256
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
LogprobsMode = Literal["processed", "raw"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text, enforced by constrained decoding.

    ``kind`` and ``spec``: ``json_schema`` (``spec``: the schema as JSON text),
    ``json_object`` (any JSON object; ``spec`` unused), ``regex`` (``spec``: the pattern),
    ``choice`` (``spec``: a JSON array of the allowed strings), ``grammar`` (``spec``: a
    grammar in the grammar backend's syntax: Lark for llguidance, as in vLLM).
    ``start_after``: the constraint holds from the first time the output has these tokens
    (a thinking model's ``</think>``: the answer is constrained, the thinking is free);
    empty: from the first token.
    """

    kind: StructuredKind
    spec: str = ""
    start_after: tuple[int, ...] = ()

    def constrained_tokens(self, generated: Sequence[int]) -> Sequence[int] | None:
        """The tokens of ``generated`` the constraint holds over: those after the first
        ``start_after`` (all of them when it is empty; None when it has not come yet)."""
        n = len(self.start_after)
        if n == 0:
            return generated
        first = self.start_after[0]
        for i, token in enumerate(generated):
            if token == first and tuple(generated[i : i + n]) == self.start_after:
                return generated[i + n :]
        return None

    def started(self, generated: Sequence[int]) -> bool:
        """Whether the constraint holds by now (``start_after`` came in ``generated``)."""
        return self.constrained_tokens(generated) is not None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0``
    disable those filters. Repetition penalty (HF semantics) applies to prompt and output
    tokens; presence and frequency penalties (OpenAI semantics) to output tokens only.
    ``logprobs`` is ``None`` for none, ``0`` for the chosen token's logprob only, ``N`` for the
    chosen token plus the top-N alternatives. ``prompt_logprobs``: also report the logprob of
    every prompt token after the first (on the request's first output), and with
    ``prompt_top_logprobs`` N the top-N alternatives at each of those positions; with
    ``prompt_target_ids`` (one row per prompt position after the first) the logprobs of
    each row's ids at its position; with ``prompt_samples`` N, N tokens drawn independently
    at each of those positions (at ``temperature`` alone: no top-k / top-p; greedy: the
    argmax) and their logprobs, the same draws for the same ``seed`` and prompt however the
    prompt is chunked. These come from the prefill's logits, the model's own.
    ``prompt_ranks``: also each prompt token's rank at its position (1: the most likely;
    vLLM's ``rank``). ``prompt_logprobs_from`` P: only positions P.. need scoring, so the
    prompt's first positions may come from the prefix cache (positions before P then report
    NaN and empty rows).

    Per-row logits processing, between the forward and the sampler: ``logit_bias`` adds
    a bias in [-100, 100] to the listed token ids' logits (OpenAI semantics); with
    ``allowed_token_ids`` every other id is masked out (vLLM's name); until ``min_tokens``
    tokens are generated, EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked out.
    ``bad_words`` (vLLM's): token-id sequences the output never contains — a sequence's
    last id is masked out wherever the output's last tokens are the rest of it (one id: it
    is always masked out); the faces tokenize the words (with and without a leading space).

    ``include_stop_str_in_output`` (vLLM's): the stop string that ended the text stays at
    its end (by default the text ends before it).

    ``cache_salt`` (vLLM's): the request reuses and leaves cached KV blocks only among
    requests with the same salt, so a tenant's prompts cannot be probed through another
    tenant's cache hits (None: the shared cache).

    ``logprobs_mode`` says which distribution reported token logprobs come from:
    ``processed`` (the default) is the one sampled from: log-softmax of the logits after
    that processing, the penalties, and division by the temperature (greedy rows: not
    divided), before the top-k / top-p / min-p truncation (vLLM's ``processed_logprobs``
    less the truncation, so alternatives keep finite values); ``raw`` is the model's own
    (log-softmax of the forward's logits). Prompt logprobs are always the model's own.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    logprobs_mode: LogprobsMode = "processed"
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    prompt_target_ids: tuple[tuple[int, ...], ...] | None = None
    prompt_samples: int = 0
    prompt_logprobs_from: int = 1
    prompt_ranks: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            "must be a 64-bit signed integer",
        )
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(
            0 <= self.prompt_top_logprobs <= MAX_LOGPROBS
            and (self.prompt_logprobs or not self.prompt_top_logprobs),
            "prompt_top_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], and needs prompt_logprobs",
        )
        targets = self.prompt_target_ids
        _check(
            targets is None
            or (
                self.prompt_logprobs
                and all(len(row) <= MAX_PROMPT_TARGETS for row in targets)
                and all(t >= 0 for row in targets for t in row)
            ),
            "prompt_target_ids",
            f"ids must be >= 0, at most {MAX_PROMPT_TARGETS} per position, and needs "
            "prompt_logprobs",
        )
        _check(
            0 <= self.prompt_samples <= MAX_LOGPROBS
            and (self.prompt_logprobs or not self.prompt_samples),
            "prompt_samples",
            f"must be in [0, {MAX_LOGPROBS}], and needs prompt_logprobs",
        )
        _check(self.prompt_logprobs_from >= 1, "prompt_logprobs_from", "must be >= 1")
        _check(
            self.prompt_logprobs or not self.prompt_ranks, "prompt_ranks", "needs prompt_logprobs"
        )
        _check(
            all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias)
            and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
            "logit_bias",
            "token ids must be >= 0 and distinct, biases in [-100, 100]",
        )
        _check(
            self.allowed_token_ids is None
            or (bool(self.allowed_token_ids) and all(t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids",
            "must be a non-empty list of token ids >= 0",
        )
        _check(
            all(word and all(t >= 0 for t in word) for word in self.bad_words),
            "bad_words",
            "must be non-empty sequences of token ids >= 0",
        )
        _check(
            self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT,
            "cache_salt",
            f"must be a non-empty string of at most {MAX_CACHE_SALT} characters",
        )

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice ``index`` of a request asking for several (``n``): a
        seeded request's choice j draws from ``seed + j`` (wrapping within 64 bits), so
        choices differ and choice 0 draws from the seed the request alone would (with a
        shared prefill its logits may differ by float rounding)."""
        if self.seed is None or index == 0:
            return self
        seed = (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """The row's logits are changed before sampling (bias, an allowed-token mask, bad
        words, or a structured-output grammar)."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.structured is not None
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)
