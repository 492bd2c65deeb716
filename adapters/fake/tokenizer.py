"""A deterministic byte-level tokenizer: fast tests, and dummy-weight models of any vocab size."""

from collections.abc import Mapping, Sequence
from typing import Any

from domain.ports import ChatMessage

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256


class ByteTokenizer:
    """The Tokenizer port with one token per UTF-8 byte: ids 0-2 special, byte ``b`` is ``b + 3``.

    Like a real byte-level tokenizer, decoding part of a multi-byte character gives U+FFFD. Ids
    outside the vocabulary decode to nothing, so a model with a larger vocabulary can sample any
    id. The chat template is ChatML-like: ``<|role|>\\ncontent<eos>\\n`` per turn, ending turns
    with the eos token as ChatML's ``<|im_end|>`` does.
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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        prefix = [BOS_ID] if add_special_tokens else []
        return prefix + [byte + BYTE_OFFSET for byte in text.encode()]

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
    ) -> list[int]:
        ids = [BOS_ID]
        if tools:
            ids += self._turn("tools", ", ".join(tool["function"]["name"] for tool in tools))
        for message in messages:
            # An assistant turn that only calls tools has no content.
            ids += self._turn(message["role"], message.get("content") or "")
        if add_generation_prompt:
            ids += self.encode("<|assistant|>\n", add_special_tokens=False)
        return ids

    def _turn(self, role: str, content: str) -> list[int]:
        text_ids = self.encode(f"<|{role}|>\n{content}", add_special_tokens=False)
        return [*text_ids, EOS_ID, *self.encode("\n", add_special_tokens=False)]
