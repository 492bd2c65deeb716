"""OpenAI's ``POST /v1/embeddings`` over the :class:`EmbeddingService`.

``input``: a string, a list of strings, a list of token ids, or a list of lists of token ids
(ids are taken as they are: include the model's special tokens, as ``/tokenize`` gives
them). Text longer than the model takes is truncated as sentence-transformers truncates it;
token ids beyond it are a 400. ``encoding_format``: ``float`` (default) or ``base64``
(little-endian float32, as OpenAI sends). ``dimensions``: only the model's own.
"""

import base64
import sys
from array import array
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, post

from adapters.http.access import check_model
from adapters.http.errors import PROMPT_FIELD, HTTPError
from adapters.http.openai.deps import Embeddings
from adapters.http.openai.params import decode_body
from adapters.http.openai.replies import json_response
from adapters.http.request_state import RequestCaller
from application.serving.embeddings import EmbeddingInput
from domain.errors import ModelNotFoundError


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Parsed by hand: msgspec takes one list type per union.
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


_decoder = msgspec.json.Decoder(EmbeddingRequest)


class EmbeddingRoutes(Controller):
    @post("/v1/embeddings", status_code=200, opt={PROMPT_FIELD: "input"})
    async def embeddings(
        self, request: Request[Any, Any, Any], caller: RequestCaller, embeddings: Embeddings
    ) -> Response[bytes]:
        body = decode_body(_decoder, request, await request.body())
        record, name = caller.record, embeddings.model_name
        record.model, record.user = body.model, body.user
        _check_model_name(body.model, name)
        check_model(request, name)
        _check_dimensions(body.dimensions, embeddings.dimensions)
        with record.timing("tokenize"):
            prepared = await embeddings.prepare(parse_input(body.input))
        tokens = sum(len(ids) for ids in prepared)
        record.prompt_tokens = tokens
        await caller.reserve(tokens)
        vectors = await embeddings.embed(prepared)
        encode = _base64 if body.encoding_format == "base64" else _floats
        data = [Embedding(i, encode(v)) for i, v in enumerate(vectors)]
        return json_response(EmbeddingList(data, name, EmbeddingUsage(tokens, tokens)))


def parse_input(raw: str | list[Any]) -> list[EmbeddingInput]:
    """The inputs of the wire's four forms (a 400 naming ``input`` for any other)."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(_is_id(x) for x in raw):
        return [raw]
    if all(isinstance(x, str) for x in raw):
        return list(raw)
    if all(isinstance(x, list) and all(_is_id(t) for t in x) for x in raw):
        return list(raw)
    raise _bad_input(
        "input must be a string, a list of strings, a list of token ids, or a list of "
        "lists of token ids"
    )


def _is_id(x: object) -> bool:
    return type(x) is int  # JSON true / false decode to bool, an int subclass


def _check_dimensions(dimensions: int | None, served: int) -> None:
    if dimensions is not None and dimensions != served:
        raise HTTPError(
            400,
            f"dimensions: this model's embeddings have {served} dimensions "
            "(shortening them is not supported)",
            "invalid_request_error",
            "dimensions",
        )


def _bad_input(message: str) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", "input")


def _floats(vector: list[float]) -> list[float]:
    return vector


def _base64(vector: list[float]) -> str:
    """Little-endian float32 bytes in base64 (what the OpenAI SDKs decode)."""
    floats = array("f", vector)
    if sys.byteorder == "big":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode("ascii")


def _check_model_name(requested: str | None, served: str) -> None:
    """``model`` may be left out (the embedding model); any other name is a 404."""
    if requested is not None and requested != served:
        raise ModelNotFoundError(f"The model `{requested}` does not exist (embeddings: `{served}`)")
