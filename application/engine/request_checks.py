"""A request checked before anything is queued: the server's limits (``EngineConfig``),
the model's vocabulary, structured-output constraints, and room in the engine.

The checks read no step-loop state but the scheduler's ``room``, so the costly ones
(tokenizing, compiling a grammar) run off the event loop and the step loop
(``AsyncEngine.prepare``). Each raises ``InvalidParameterError`` naming the field (a 400),
``EmptyPromptError`` / ``PromptTooLongError``, or ``QueueFullError`` (a 503: not now).
"""

from collections.abc import Callable, Iterable

from domain.config import EngineConfig
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)
from domain.ports import STRUCTURED_PARAM, GrammarCompiler, Tokenizer
from domain.sampling import SamplingParams


class RequestChecks:
    """``room``: requests the scheduler can take now. ``vocab_size``: the model's, when it
    differs from the tokenizer's (token-id prompts are checked against it: an id past the
    embedding would fail the whole step). ``grammar``: checks structured-output
    constraints (None: they are refused)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        *,
        room: Callable[[], int],
        vocab_size: int | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.room = room
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        self.grammar = grammar

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

    def check_room(self, count: int, n: int = 1) -> None:
        """``count`` prompts of ``n`` choices each can be queued together now:
        ``InvalidParameterError`` when they never can (beyond ``max_prompts_per_request``,
        ``max_n`` or the engine's capacity), ``QueueFullError`` when not now. Cheap:
        callers check before tokenizing."""
        if not 1 <= n <= self.config.max_n:
            raise InvalidParameterError("n", f"must be in [1, {self.config.max_n}]")
        limit = min(self.config.max_prompts_per_request, self.config.capacity)
        if count > limit:
            raise InvalidParameterError(
                "prompt", f"{count} prompts in one request; at most {limit} fit"
            )
        if count * n > self.config.capacity:
            raise InvalidParameterError(
                "n", f"{count * n} choices in one request; at most {self.config.capacity} fit"
            )
        count *= n
        if count > self.room():
            raise QueueFullError(
                f"the engine is full ({self.config.max_num_seqs} running and "
                f"{self.config.max_waiting_requests} waiting at most); retry later"
            )

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        structured_param: str = STRUCTURED_PARAM,
        truncate_prompt_tokens: int | None = None,
    ) -> list[int]:
        """The prompt's token ids, validated (empty, too large, out-of-vocabulary ids, too
        long for ``max_model_len`` with ``params``, the server's limits on ``params``): what
        ``Engine.add_request`` checks, queueing nothing. Touches no engine state, so it may
        run on another thread than the step loop. ``structured_param``: the request field
        the output constraint came from (its errors name it). ``truncate_prompt_tokens``:
        keep only the prompt's last N tokens (:meth:`truncate`) before the length check."""
        if not prompt:  # checked before tokenizing: a BOS token would hide an empty string
            raise EmptyPromptError()
        self.check_params(params)
        if isinstance(prompt, str):
            self.check_prompt_size([prompt])
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        prompt_ids = self.truncate(prompt_ids, truncate_prompt_tokens)
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            raise PromptTooLongError(len(prompt_ids), params.max_tokens, self.config.max_model_len)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(
                "prompt", f"token id {bad} is out of vocabulary (ids are 0..{self.vocab_size - 1})"
            )
        self.check_token_ids(params)
        targets = params.prompt_target_ids
        if targets is not None and len(targets) != len(prompt_ids) - 1:
            raise InvalidParameterError(
                "prompt_target_ids",
                f"{len(targets)} rows; one per prompt position after the first "
                f"({len(prompt_ids) - 1})",
            )
        self.check_structured(params, structured_param)
        return prompt_ids

    def truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many
        as the context holds, ``max_model_len``; None: all)."""
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.config.max_model_len
        if keep < 1:
            raise InvalidParameterError(
                "truncate_prompt_tokens", "must be -1 (the context) or an integer >= 1"
            )
        return prompt_ids[-keep:]

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in ``logit_bias`` / ``allowed_token_ids`` / ``prompt_target_ids`` /
        ``bad_words`` are in the model's vocabulary."""
        for name, ids in (
            ("bad_words", [t for word in params.bad_words for t in word]),
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("prompt_target_ids", [t for row in params.prompt_target_ids or () for t in row]),
        ):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidParameterError(
                    name, f"token id {bad} is out of vocabulary (ids are 0..{self.vocab_size - 1})"
                )

    def check_structured(self, params: SamplingParams, param: str = STRUCTURED_PARAM) -> None:
        """A structured-output constraint compiles for this model (may take milliseconds:
        call it off the event loop, as ``prepare`` is); errors name ``param``."""
        if params.structured is None:
            return
        try:
            if self.grammar is None:
                raise InvalidParameterError(
                    STRUCTURED_PARAM, "structured outputs are not available on this server"
                )
            self.grammar.check(params.structured)
        except InvalidParameterError as e:
            if e.param != STRUCTURED_PARAM or param == STRUCTURED_PARAM:
                raise
            raise e.renamed(param) from e


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
