"""Ports: what the domain and application need from the outside world."""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from domain.request import StepOutput
    from domain.sampling import StructuredOutput
    from domain.scheduler import RunnerOutput, SchedulerOutput

ChatMessage = Mapping[str, Any]


class Tokenizer(Protocol):
    """Text <-> token ids, and chat rendering through the model's chat template.

    Held by tests/contract/test_tokenizer_contract.py against the fake and the real adapter.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's eos plus the model's generation config's."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(
        self, text: str, *, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: what the tokenizer adds around a
        sequence (BOS). ``parse_special_tokens``: special-token text (``<|im_start|>``) in
        ``text`` becomes the special token; False: it is plain text like any other."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; a character whose bytes are incomplete decodes to U+FFFD."""
        ...

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        trust_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation; ``InvalidParameterError`` if the model has no template.

        ``add_generation_prompt`` appends the opener of the assistant's turn. ``tools`` are
        OpenAI-style function definitions; a template without a tools section ignores them.
        Special tokens come from the template only: special-token text inside the messages
        is plain text (tokenized as ``encode(..., parse_special_tokens=False)`` would), so a
        message cannot forge a turn; ``trust_special_tokens`` parses it as control tokens.
        ``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. ``enable_thinking``); they never replace the
        messages, tools, generation prompt or special tokens.
        """
        ...


class ModelRunner(Protocol):
    """Runs one scheduled step: one batched forward plus sampling, returning token ids."""

    def execute(self, batch: "SchedulerOutput") -> "RunnerOutput": ...

    def release(self, request_ids: Sequence[str]) -> None:
        """Free what the runner keeps per request (generator, grammar matcher)."""
        ...


class OutputSink(Protocol):
    """Where step outputs go (per-request queues, a list in tests). Never blocks."""

    def publish(self, output: "StepOutput") -> None: ...


class Embedder(Protocol):
    """A sentence-embedding model: texts -> token ids -> unit-length vectors.

    Held by tests/contract/test_embedder_contract.py against the fake and the real adapter.
    """

    @property
    def dimensions(self) -> int:
        """Length of every vector."""
        ...

    @property
    def max_tokens(self) -> int:
        """Tokens one input may have, special tokens included (``tokenize`` truncates to it)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids with the model's special tokens, at most ``max_tokens``."""
        ...

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One unit-length vector per input (1 to ``max_tokens`` ids each), in order; an
        input's vector does not depend on the others in the call."""
        ...


# The parameter a structured-output error names (a face may rename it to its own field).
STRUCTURED_PARAM = "response_format"


class GrammarCompiler(Protocol):
    """Compiles structured-output constraints (JSON schemas, regexes, choices, grammars)
    for the model's tokenizer; the engine checks each request's constraint with it when the
    request is prepared. The torch runner's matchers come from the same adapter
    (``adapters/grammar``)."""

    def check(self, structured: "StructuredOutput") -> None:
        """``InvalidParameterError`` (param ``STRUCTURED_PARAM``) when ``structured`` is
        invalid or uses what the backend does not support."""
        ...
