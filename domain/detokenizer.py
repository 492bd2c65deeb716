"""Incremental detokenization: generated token ids in, text deltas out, never half a character."""

from collections.abc import Sequence

from domain.ports import Tokenizer

# Prompt tokens decoded ahead of the first generated one, so that its text is decoded the way it
# reads after the prompt (a SentencePiece "▁Hello" keeps its space, which it loses at the start
# of a sequence).
PROMPT_CONTEXT_TOKENS = 5

# What a byte-level decoder gives for a character whose bytes have not all arrived yet.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, at O(1) cost per token.

    vLLM's prefix/read-offset technique: ``_ids`` is a short window whose first ``_read_offset``
    ids produced text that was already emitted. They stay as context because a token's text
    depends on its neighbours (leading-space rules, characters spanning tokens); each step
    decodes the window with and without the new ids and emits the difference. A delta ending in
    U+FFFD is an unfinished character: it is held back until the next tokens complete it.

    Without prompt ids, the deltas of ``push`` and the final ``flush`` concatenate to
    ``tokenizer.decode(generated_ids)``; with them, to the generated ids' text as it reads
    after the prompt.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes (often "", never half a char)."""
        self._ids.append(token_id)
        delta = self._pending_text()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        """Returns the held-back tail at the end of generation, unfinished character included."""
        delta = self._pending_text()
        self._advance()
        return delta

    def _pending_text(self) -> str:
        emitted = self._decode(self._ids[: self._read_offset])
        return self._decode(self._ids)[len(emitted) :]

    def _advance(self) -> None:
        # The ids just emitted become the context of the next step; older ones are dropped.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
