"""What one API request did, gathered while it is served and read when it ends.

The outermost HTTP middleware opens a :class:`RequestRecord` for every request and keeps it
in the ASGI scope's state under :data:`RECORD_KEY` (the HTTP faces'
``request.state.record``); the faces fill it in (tenant, model, tokens, finish reasons,
first-token time) and the observability adapters read it at the end: the canonical log
line, the server span's attributes, the request metrics. Plain data, no text of prompts
or outputs.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

RECORD_KEY = "record"


@dataclass
class RequestRecord:
    request_id: str = ""
    method: str = ""
    route: str = ""  # the route's template (``/v1/completions``), else the path
    started_s: float = field(default_factory=time.monotonic)
    status: int | None = None
    tenant_id: str | None = None
    key_id: str | None = None  # the caller's API key by its public id (``key_...``), never the key
    model: str | None = None
    rollout: str | None = None  # the rollout whose name was asked for (``model``: its pick)
    user: str | None = None  # the OpenAI ``user`` field, as the client sent it
    stream: bool = False
    # The W3C trace context engine requests are queued with (the server span's).
    trace: tuple[tuple[str, str], ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompts', found in the prefix cache (once per prompt)
    finish_reasons: list[str] = field(default_factory=list)
    first_token_s: float | None = None
    error_code: str | None = None  # the error type of an error reply or event
    # The output cap that cut what the request asked (--max-output-tokens, the tenant's).
    output_cap: int | None = None
    # Named phases the request spent time in (``tokenize``): (name, start, end), monotonic.
    timings: list[tuple[str, float, float]] = field(default_factory=list)

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        """Time a phase of the request (it becomes a child span of the request's)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.timings.append((name, start, time.monotonic()))

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.started_s
