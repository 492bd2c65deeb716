"""InputProcessor: a request's inputs made ready for the engine before anything is queued
(vLLM's ``InputProcessor``): the cheap checks, chat rendering, tokenizing and validation
(:class:`RequestChecks`), and detokenizing for the replies.

The costly steps (tokenizing, rendering, compiling a grammar) run on a small thread pool
(``EngineConfig.prepare_threads``), never on the event loop the engine steps on: a
megabyte prompt costs its own request time, not every stream's (the tokenizer releases
the GIL while it encodes). The engine client (:mod:`application.engine.engine_client`) queues
what this prepared.
"""

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from application.engine.request_checks import RequestChecks
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.ports import STRUCTURED_PARAM, ChatMessage, Tokenizer
from domain.sampling import SamplingParams

T = TypeVar("T")


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, checks: RequestChecks) -> None:
        self.config, self.tokenizer, self.checks = config, tokenizer, checks
        self._executor: ThreadPoolExecutor | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # Cheap checks before any tokenizing: raise InvalidParameterError / QueueFullError.
    def check_params(self, params: SamplingParams) -> None:
        self.checks.check_params(params)

    def check_prompt_size(self, texts: Iterable[str], param: str = "prompt") -> None:
        self.checks.check_prompt_size(texts, param)

    def check_room(self, count: int, n: int = 1) -> None:
        self.checks.check_room(count, n)

    def truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """:meth:`RequestChecks.truncate`: the prompt's last ``keep`` tokens."""
        return self.checks.truncate(prompt_ids, keep)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded alone, special tokens included (logprobs' token strings;
        cheap: runs on the caller's thread)."""
        decode = self.tokenizer.decode
        return [decode([t], skip_special_tokens=False) for t in token_ids]

    async def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Chat messages -> prompt token ids through the model's chat template
        (``template_kwargs``: more variables for it). Special-token text in the messages
        is plain text unless the engine's config trusts it."""
        trust, tokenizer = self.config.trust_chat_special_tokens, self.tokenizer
        return await self._off_loop(
            lambda: tokenizer.render_chat(
                messages, tools=tools, trust_special_tokens=trust, template_kwargs=template_kwargs
            )
        )

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, after the prompt-size limit."""
        self.checks.check_prompt_size([text])
        tokenizer = self.tokenizer
        return await self._off_loop(
            lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (ids outside the vocabulary: InvalidParameterError)."""
        vocab = self.checks.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameterError(
                "tokens", f"token id {bad} is out of vocabulary (ids are 0..{vocab - 1})"
            )
        tokenizer = self.tokenizer
        return await self._off_loop(lambda: tokenizer.decode(token_ids, skip_special_tokens=False))

    async def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        structured_param: str = STRUCTURED_PARAM,
        truncate_prompt_tokens: int | None = None,
    ) -> list[int]:
        """:meth:`RequestChecks.prepare`: the prompt's token ids, tokenized and validated
        (``truncate_prompt_tokens``: the last N kept)."""
        checks = self.checks
        return await self._off_loop(
            lambda: checks.prepare(
                prompt,
                params,
                structured_param=structured_param,
                truncate_prompt_tokens=truncate_prompt_tokens,
            )
        )

    async def bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token-id sequences: each word (leading spaces stripped)
        tokenized alone, and with one leading space when that gives as many tokens and
        another first token (the word inside a text, for tokenizers that mark spaces)."""
        limit, size = (
            self.config.max_stop_strings,
            sum(len(w.encode("utf-8", "surrogatepass")) for w in words),
        )
        if len(words) > limit:
            raise InvalidParameterError("bad_words", f"{len(words)} entries, more than {limit}")
        if size > self.config.max_stop_bytes:
            raise InvalidParameterError(
                "bad_words", f"{size} bytes in all, more than {self.config.max_stop_bytes}"
            )
        tokenizer = self.tokenizer

        def encode() -> tuple[tuple[int, ...], ...]:
            out: list[tuple[int, ...]] = []
            for word in words:
                bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
                if not bare:
                    raise InvalidParameterError("bad_words", "a bad word has no tokens")
                out.append(bare)
                spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
                if len(spaced) == len(bare) and spaced[0] != bare[0]:
                    out.append(spaced)
            return tuple(out)

        return await self._off_loop(encode)

    def close(self) -> None:
        """Stop the thread pool (a later call starts another)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _off_loop(self, work: Callable[[], T]) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.config.prepare_threads, thread_name_prefix="prepare"
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)
