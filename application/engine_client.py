"""EngineClient: what the driving adapters (HTTP faces, the Tinker sampler) need from the
engine loop. :class:`application.async_engine.AsyncEngine` implements it; faces depend on
this protocol only, so a test or another engine (a remote one, a fake) can stand in."""

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol

from domain.ports import ChatMessage
from domain.request import NO_CONTEXT, RequestContext, StepOutput
from domain.sampling import SamplingParams


class OwnedRequests(Protocol):
    """The engine requests one caller (an HTTP request) queued; ``close`` aborts the rest.
    ``context``: who asked (tenant, priority, trace), given to every request admitted."""

    context: RequestContext

    def admit(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        adapter_id: str | None = None,
    ) -> list[AsyncIterator[StepOutput]]:
        """Queue ``n`` choices of each prompt (``n`` request ids per prompt, choice j of
        prompt i at ``i * n + j``), all or none; one stream per request id. ``adapter_id``:
        the LoRA adapter they run with (None: the base model)."""
        ...

    def close(self) -> None: ...

    def fail(self, error: str) -> None:
        """Like ``close``, but each stream still open ends with an ``error`` output."""
        ...


class EngineClient(Protocol):
    @property
    def healthy(self) -> bool:
        """The engine loop runs (not crashed, not stopped)."""
        ...

    @property
    def max_seq_len(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    # Cheap checks before any tokenizing: raise InvalidParameterError / QueueFullError.
    def check_params(self, params: SamplingParams) -> None: ...

    def check_prompt_size(self, texts: Iterable[str], param: str = "prompt") -> None: ...

    def check_room(self, count: int, n: int = 1) -> None: ...

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text decoded alone (cheap: runs on the caller's thread)."""
        ...

    async def render_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]: ...

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    async def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]: ...

    def group(self, context: RequestContext = NO_CONTEXT) -> OwnedRequests: ...

    async def stream(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
        context: RequestContext = NO_CONTEXT,
    ) -> AsyncIterator[StepOutput]: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...
