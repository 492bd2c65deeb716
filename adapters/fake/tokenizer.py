"""A deterministic byte-level tokenizer: fast tests, and dummy-weight models of any vocab size."""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from domain.ports import ChatMessage

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256
_SPECIAL_TEXT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


class ByteTokenizer:
    """The Tokenizer port with one token per UTF-8 byte: ids 0-2 special, byte ``b`` is ``b + 3``.

    Like a real byte-level tokenizer, decoding part of a multi-byte character gives U+FFFD. Ids
    outside the vocabulary decode to nothing, so a model with a larger vocabulary can sample any
    id. Like a real tokenizer, ``encode`` parses special-token text (``<eos>``) into the special
    token unless told not to. The chat template is ChatML-like: ``<|role|>\\ncontent<eos>\\n``
    per turn, ending turns with the eos token as ChatML's ``<|im_end|>`` does; message content
    is plain text unless ``trust_special_tokens``.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID})

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def has_chat_template(self) -> bool:
        return True

    @property
    def chat_template(self) -> str | None:
        """No Jinja template: its own ChatML-like turns (tool calls: the default format)."""
        return None

    @property
    def special_ids(self) -> range:
        """The control tokens' ids (below ``BYTE_OFFSET``)."""
        return range(BYTE_OFFSET)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, special tokens as their text (ids below ``BYTE_OFFSET``)."""
        return [t.encode() for t in SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]

    def encode(
        self, text: str, *, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        start = 0
        for match in _SPECIAL_TEXT.finditer(text) if parse_special_tokens else ():
            ids += _bytes(text[start : match.start()])
            ids.append(SPECIAL_TOKENS.index(match.group()))
            start = match.end()
        return ids + _bytes(text[start:])

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = bytearray()
        for token_id in token_ids:
            if BYTE_OFFSET <= token_id < VOCAB_SIZE:
                data.append(token_id - BYTE_OFFSET)
            elif 0 <= token_id < BYTE_OFFSET and not skip_special_tokens:
                data += SPECIAL_TOKENS[token_id].encode()
        return data.decode(errors="replace")

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        trust_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        def turn(role: str, content: str) -> list[int]:
            text = self.encode(
                f"<|{role}|>\n{content}",
                add_special_tokens=False,
                parse_special_tokens=trust_special_tokens,
            )
            return [*text, EOS_ID, *_bytes("\n")]

        ids = [BOS_ID]
        if tools:
            ids += turn("tools", ", ".join(tool["function"]["name"] for tool in tools))
        for message in messages:
            # An assistant turn that only calls tools has no content.
            ids += turn(message["role"], message.get("content") or "")
        if add_generation_prompt:
            ids += _bytes("<|assistant|>\n")
            if (template_kwargs or {}).get("enable_thinking") is False:  # as Qwen3's does
                ids += _bytes("<think>\n\n</think>\n\n")
        return ids


def _bytes(text: str) -> list[int]:
    return [byte + BYTE_OFFSET for byte in text.encode()]
