"""Queueing one request on a synchronous :class:`~application.engine.engine.Engine` the way the
use case does: its checks prepare the prompt (validated, tokenized), one
:class:`~domain.request.AdmitCall` queues it."""

from application.engine.engine import Engine
from domain.request import NO_CONTEXT, AdmitCall, Request, RequestContext
from domain.sampling import SamplingParams


def add_request(
    engine: Engine,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    adapter_id: str | None = None,
    context: RequestContext = NO_CONTEXT,
) -> Request:
    """Validate, tokenize and queue ``prompt``; raises before anything is queued."""
    prompt_ids = engine.checks.prepare(prompt, params)
    call = AdmitCall.one(request_id, prompt_ids, params, adapter_id=adapter_id, context=context)
    [request] = engine.admit(call)
    return request
