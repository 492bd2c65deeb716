"""HFTokenizer: the Tokenizer port over a transformers tokenizer read from a local folder."""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from domain.errors import InvalidParameterError, ModelLoadError
from domain.ports import ChatMessage


class HFTokenizer:
    """A transformers fast tokenizer behind the Tokenizer port."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, eos_token_ids: frozenset[int], name: str
    ) -> None:
        self._tokenizer = tokenizer
        # The detokenizer decodes on every generated token, and the Rust tokenizer does it ~4x
        # faster than the transformers wrapper around it, whose only extra step (space clean-up)
        # transformers skips for BPE vocabularies anyway.
        self._backend = tokenizer.backend_tokenizer
        self._eos_token_ids = eos_token_ids
        self._name = name

    @classmethod
    def from_folder(cls, path: Path) -> "HFTokenizer":
        """Loads the tokenizer files of a model folder; never touches the network."""
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot load a tokenizer: {exc}") from exc
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ModelLoadError(f"{path}: needs a fast tokenizer (tokenizer.json)")
        eos = _generation_config_eos_ids(path)
        if tokenizer.eos_token_id is not None:
            eos |= {tokenizer.eos_token_id}
        return cls(tokenizer, eos, path.name)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if not self.has_chat_template:
            raise InvalidParameterError("messages", f"model {self._name} has no chat template")
        try:
            text = self._tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                tools=[dict(tool) for tool in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateError as exc:  # the template rejects the conversation (raise_exception)
            raise InvalidParameterError("messages", str(exc)) from exc
        assert isinstance(text, str), "one conversation renders to one string"
        # The template writes the special tokens (bos included) itself.
        return self.encode(text, add_special_tokens=False)


def _generation_config_eos_ids(folder: Path) -> frozenset[int]:
    """The ``eos_token_id`` (an int or a list) of the folder's generation_config.json, if any."""
    path = folder / "generation_config.json"
    if not path.exists():
        return frozenset()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable: {exc}") from exc
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
