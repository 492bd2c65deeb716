"""Wire types of the native ``POST /v1/generate`` endpoint."""

import msgspec


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    prompt: str | list[int]
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0
    stream: bool = True  # accepted; the endpoint always streams
    stop: str | list[str] | None = None
    seed: int | None = None


class TokenEvent(msgspec.Struct):
    token: str
    token_id: int


class GenerateUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DoneEvent(msgspec.Struct):
    finish_reason: str | None
    usage: GenerateUsage


class ErrorEvent(msgspec.Struct):
    error: str


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail
