"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the body translated into
a chat job (``params.py``), one call to the completion service (the chat completions'
use case), the message whole or as Anthropic's event stream (``replies.py``). Errors
raise as they come; the router writes them in Anthropic's format."""

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import ServerSentEvent

from adapters.http.anthropic.params import decode_body, messages_job, prompt_job, user
from adapters.http.anthropic.replies import PING, MessageReply, json_response, new_message_id
from adapters.http.anthropic.schemas import CountTokensRequest, MessagesRequest, TokenCount
from adapters.http.errors import PROMPT_FIELD
from adapters.http.openai.deps import Completions, Names
from adapters.http.request_state import RequestCaller
from adapters.http.streaming import SSE_PING
from application.serving.chat_prompts import tool_texts

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


class MessageRoutes(Controller):
    @post("/v1/messages", status_code=200, opt={PROMPT_FIELD: "messages", SSE_PING: PING})
    async def messages(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: Completions,
        names: Names,
    ) -> Response[bytes] | ServerSentEvent:
        body = decode_body(_messages_decoder, request, await request.body())
        record = caller.record
        record.model, record.user, record.stream = body.model, user(body), bool(body.stream)
        model = names.resolve(request, body.model)
        job = messages_job(body, model.adapter_id)
        started = await completions.chat(job, caller)
        reply = MessageReply(
            new_message_id(),
            model.id,
            completions.chats.format,
            job.tools,
            started.reasoning,
        )
        [stream] = started.streams
        if body.stream:
            return reply.stream(stream, len(started.prompts[0]))
        return await reply.body(request, stream)

    @post("/v1/messages/count_tokens", status_code=200, opt={PROMPT_FIELD: "messages"})
    async def count_tokens(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: Completions,
        names: Names,
    ) -> Response[bytes]:
        """The prompt's tokens as ``/v1/messages`` would render it (system, messages,
        tools), nothing queued."""
        body = decode_body(_count_decoder, request, await request.body())
        caller.record.model = body.model
        model = names.resolve(request, body.model)
        job = prompt_job(body, model.adapter_id)
        texts = [*(m["content"] for m in job.messages), *tool_texts(job.tools)]
        completions.inputs.check_prompt_size(texts, "messages")
        with caller.record.timing("render_chat"):
            prompt = await completions.chats.render(job.messages, job.tools, job.template_kwargs)
        return json_response(TokenCount(len(prompt)))
