"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (OpenAI-format errors, the same keys
and model scopes as the OpenAI endpoints).

``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``, default true) or chat
``messages`` (rendered through the chat template, as a chat completion would be) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``: each token's own text). ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}``.
"""

from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, post

from adapters.http.errors import HTTPError
from adapters.http.openai.deps import Inputs, Names
from adapters.http.openai.params import decode_body
from adapters.http.openai.replies import json_response
from adapters.http.served_models import ModelNames


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
Body = TypeVar("Body", TokenizeRequest, DetokenizeRequest)


class TokenizeRoutes(Controller):
    """Any served model name tokenizes alike (adapters do not change the tokenizer)."""

    @post("/tokenize", status_code=200)
    async def tokenize(
        self, request: Request[Any, Any, Any], inputs: Inputs, names: Names
    ) -> Response[bytes]:
        body = await _body(_tokenize_decoder, request, names)
        if body.messages is not None and body.prompt is None:
            inputs.check_prompt_size([str(m.get("content", "")) for m in body.messages], "messages")
            tokens = await inputs.render_chat(body.messages)
        elif body.prompt is not None and body.messages is None:
            tokens = await inputs.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise HTTPError(
                400, "give either `prompt` or `messages`", "invalid_request_error", "prompt"
            )
        strs = None
        if body.return_token_strs:
            strs = [await inputs.detokenize([t]) for t in tokens]
        return json_response(TokenizeResponse(len(tokens), inputs.max_model_len, tokens, strs))

    @post("/detokenize", status_code=200)
    async def detokenize(
        self, request: Request[Any, Any, Any], inputs: Inputs, names: Names
    ) -> Response[bytes]:
        body = await _body(_detokenize_decoder, request, names)
        return json_response(DetokenizeResponse(await inputs.detokenize(body.tokens)))


async def _body(
    decoder: msgspec.json.Decoder[Body], request: Request[Any, Any, Any], names: ModelNames
) -> Body:
    """The request's body, once the model it names (if any) is one this server serves."""
    body = decode_body(decoder, request, await request.body())
    names.resolve(request, body.model)
    return body
