"""EngineClient: what the driving adapters (HTTP faces, the Tinker sampler) need from the
engine loop: queue prepared requests, stream their outputs, abort them.
:class:`application.engine.async_engine.AsyncEngine` implements it; faces depend on this protocol
only, so a test or another engine (a remote one, a fake) can stand in. What comes before
queueing (checks, rendering, tokenizing) is its :class:`InputProcessor`'s (``inputs``)."""

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from application.engine.input_processor import InputProcessor
from domain.request import NO_CONTEXT, AdmitCall, RequestContext, StepOutput
from domain.sampling import SamplingParams


class OwnedRequests(Protocol):
    """The engine requests one caller (an HTTP request) queued; ``close`` aborts the rest.
    ``context``: who asked (tenant, priority, trace), what its callers build their
    :class:`AdmitCall` with."""

    context: RequestContext

    def admit(self, call: AdmitCall) -> list[AsyncIterator[StepOutput]]:
        """Queue ``call`` (built with this group's ``context``), all or none; one stream per
        request id."""
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


class AdmittingClient:
    """What :class:`~application.engine.async_engine.AsyncEngine` and
    :class:`~application.engine.remote_engine.RemoteEngine` share: ``admit``, ``stream`` and
    ``group`` over their own ``submit`` (one :class:`AdmitCall` queued, one output stream
    per request id), ``abort`` and ``fail``."""

    inputs: InputProcessor

    def submit(self, call: AdmitCall) -> list[AsyncIterator[StepOutput]]:
        """Queue ``call``'s prompts all together or none; one output stream per request id."""
        raise NotImplementedError

    def abort(self, request_ids: Sequence[str]) -> None:
        raise NotImplementedError

    def fail(self, request_ids: Sequence[str], error: str) -> None:
        raise NotImplementedError

    def group(self, context: RequestContext = NO_CONTEXT) -> "RequestGroup":
        """A new group of requests owned by one caller (see :class:`RequestGroup`), queued
        with ``context`` (the caller may refine it before admitting: ``group.context``)."""
        return RequestGroup(self, context)

    async def stream(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        adapter_id: str | None = None,
        context: RequestContext = NO_CONTEXT,
    ) -> AsyncIterator[StepOutput]:
        """Queue a request and yield its outputs until it finishes. Validation errors raise
        before the first yield; leaving early (a client disconnect) aborts the request."""
        prompt_ids = await self.inputs.prepare(prompt, params)
        call = AdmitCall.one(request_id, prompt_ids, params, adapter_id=adapter_id, context=context)
        [outputs] = self.submit(call)
        return outputs


class RequestGroup:
    """The engine requests one caller queued, e.g. everything one HTTP request started.

    ``close`` aborts every one of them still queued or running, at once (synchronously),
    however the caller ended: an error after part of its work was queued, a client gone
    before its stream was ever read (a generator never started cannot clean up after
    itself), a cancellation. Closing twice is harmless.
    """

    def __init__(self, engine: AdmittingClient, context: RequestContext = NO_CONTEXT) -> None:
        self._engine = engine
        self._request_ids: list[str] = []
        self.context = context  # who asked: the context its callers build their calls with

    def admit(self, call: AdmitCall) -> list[AsyncIterator[StepOutput]]:
        """``engine.submit(call)``, its request ids remembered for ``close``."""
        streams = self._engine.submit(call)
        self._request_ids.extend(call.request_ids)
        return streams

    def close(self) -> None:
        self._engine.abort(self._request_ids)
        self._request_ids = []

    def fail(self, error: str) -> None:
        """End every request still running, its stream's last output an ``error``."""
        self._engine.fail(self._request_ids, error)
        self._request_ids = []
