"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (OpenAI-format errors, the same keys
and model scopes as the OpenAI endpoints).

``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``, default true) or chat
``messages`` (rendered through the chat template, as a chat completion would be) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``: each token's own text). ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}``.
"""

from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler

from adapters.http.access import inference_guard
from adapters.http.errors import OPENAI_ERRORS, HTTPError
from adapters.http.openai_routes import decode_body
from adapters.http.served_models import ModelNames
from application.access import Access
from application.engine_client import EngineClient
from application.served_models import ServedModels

_encoder = msgspec.json.Encoder()


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def tokenize_routes(
    engine: EngineClient,
    model_name: str,
    access: Access | None = None,
    names: ModelNames | None = None,
) -> list[HTTPRouteHandler]:
    """``names``: the models served (default: ``model_name`` alone); any of them
    tokenizes alike (adapters do not change the tokenizer)."""
    names = names or ModelNames(ServedModels([model_name], model_name))
    guards = [inference_guard(access, OPENAI_ERRORS)] if access is not None else []

    @post("/tokenize", status_code=200, guards=guards)
    async def tokenize(request: Request[Any, Any, Any]) -> Response[bytes]:
        body = decode_body(_tokenize_decoder, request, await request.body())
        names.resolve(request, body.model, OPENAI_ERRORS)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(
                400, "give either `prompt` or `messages`", "invalid_request_error", "prompt"
            )
        try:
            if body.prompt is not None:
                tokens = await engine.tokenize(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
            else:
                assert body.messages is not None
                engine.check_prompt_size([str(m.get("content", "")) for m in body.messages])
                tokens = await engine.render_chat(body.messages)
        except Exception as e:
            raise OPENAI_ERRORS.error(e, "prompt" if body.prompt is not None else "messages") from e
        strs = None
        if body.return_token_strs:
            strs = [await engine.detokenize([t]) for t in tokens]
        reply = TokenizeResponse(len(tokens), engine.max_seq_len, tokens, strs)
        return Response(_encoder.encode(reply), media_type="application/json")

    @post("/detokenize", status_code=200, guards=guards)
    async def detokenize(request: Request[Any, Any, Any]) -> Response[bytes]:
        body = decode_body(_detokenize_decoder, request, await request.body())
        names.resolve(request, body.model, OPENAI_ERRORS)
        try:
            text = await engine.detokenize(body.tokens)
        except Exception as e:
            raise OPENAI_ERRORS.error(e, "tokens") from e
        return Response(_encoder.encode(DetokenizeResponse(text)), media_type="application/json")

    return [tokenize, detokenize]
