"""EngineClient: what the driving adapters (HTTP faces, the Tinker sampler) need from the
engine loop: queue prepared requests, stream their outputs, abort them.
:class:`application.async_engine.AsyncEngine` implements it; faces depend on this protocol
only, so a test or another engine (a remote one, a fake) can stand in. What comes before
queueing (checks, rendering, tokenizing) is its :class:`InputProcessor`'s (``inputs``)."""

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from application.input_processor import InputProcessor
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
    def inputs(self) -> InputProcessor:
        """What prepares requests for this engine (its tokenizer, limits and checks)."""
        ...

    @property
    def healthy(self) -> bool:
        """The engine loop runs (not crashed, not stopped)."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

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
