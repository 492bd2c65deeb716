"""HFTokenizer: the Tokenizer port over a model folder's ``tokenizer.json``.

The Rust ``tokenizers`` library does encoding and decoding (BOS/EOS come from the file's
post-processor, as in transformers); the chat template is rendered with the same Jinja
environment transformers uses. Not importing transformers keeps a model load well under
a second for the tokenizer (transformers' AutoTokenizer takes ~2 s here).

Encoding goes through ``encode_batch_fast``, which releases the GIL: a long prompt tokenized
on a worker thread does not stall the event loop's thread (``encode`` holds the GIL).

Special tokens in chat messages: the template is rendered from a copy of its source in
which every special token it writes is replaced by a marker (a private-use string with a
random nonce), the text is encoded by a twin tokenizer that reads special-token text as
plain text and knows each marker as an added token with its special token's strip rules,
and marker ids are mapped back. So only the template's own special tokens are control
tokens; the same text in a message is tokenized as the literal characters it is.
"""

import json
import secrets
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from domain.errors import InvalidParameterError, ModelLoadError
from domain.ports import ChatMessage

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFTokenizer:
    """A ``tokenizers`` tokenizer plus the folder's chat template and special tokens."""

    def __init__(
        self,
        tokenizer: RustTokenizer,
        *,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        special_tokens: Mapping[str, str],
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._template_source = chat_template
        self._template = _compile(chat_template) if chat_template else None
        self._special_tokens = dict(special_tokens)
        self._twin: _PlainTextTwin | None = None  # built on first use (a second or so)
        self._twin_lock = threading.Lock()

    @classmethod
    def from_folder(cls, path: Path) -> "HFTokenizer":
        """Loads the tokenizer files of a model folder; never touches the network."""
        try:
            tokenizer = RustTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises plain Exception
            raise ModelLoadError(f"{path}: cannot load a tokenizer: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        special = {k: _token_text(config[k]) for k in _SPECIAL_TOKENS if config.get(k)}
        eos = set(_generation_config_eos_ids(path))
        if (eos_id := tokenizer.token_to_id(special.get("eos_token", ""))) is not None:
            eos.add(eos_id)
        return cls(
            tokenizer,
            eos_token_ids=frozenset(eos),
            chat_template=_chat_template(path, config),
            special_tokens=special,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template(self) -> str | None:
        """The template's source (the composition root picks a tool-call format by it)."""
        return self._template_source

    def encode(
        self, text: str, *, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        if not parse_special_tokens:
            return self._plain_text_twin().encode(text, add_special_tokens=add_special_tokens)
        [encoding] = self._tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        trust_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self._template is None:
            raise InvalidParameterError(
                "messages",
                "this model has no chat template (a base model?): give it a plain-text "
                "completion prompt instead",
            )
        if trust_special_tokens:
            template, special_tokens = self._template, self._special_tokens
        else:
            twin = self._plain_text_twin()
            template, special_tokens = twin.template, twin.special_tokens
        try:
            text = template.render(
                {
                    **(template_kwargs or {}),  # what follows wins: never replaced
                    "messages": [dict(m) for m in messages],
                    "tools": [dict(t) for t in tools] if tools else None,
                    "add_generation_prompt": add_generation_prompt,
                    **special_tokens,
                }
            )
        except TemplateError as exc:  # the template rejects the conversation (raise_exception)
            raise InvalidParameterError("messages", str(exc)) from exc
        # The template writes the special tokens (bos included) itself.
        if trust_special_tokens:
            return self.encode(text, add_special_tokens=False)
        return self._plain_text_twin().encode_marked(text)

    def _plain_text_twin(self) -> "_PlainTextTwin":
        with self._twin_lock:
            if self._twin is None:
                self._twin = _PlainTextTwin(
                    self._tokenizer, self._template_source or "", self._special_tokens
                )
            return self._twin


class _PlainTextTwin:
    """A copy of the tokenizer that reads special-token text as plain text, and the chat
    template with a marker in place of each special token it writes (see the module doc)."""

    def __init__(
        self, tokenizer: RustTokenizer, template: str, special_tokens: Mapping[str, str]
    ) -> None:
        self._tokenizer = RustTokenizer.from_str(tokenizer.to_str())
        self._tokenizer.encode_special_tokens = True
        written = "".join([template, *special_tokens.values()])
        specials = {
            token.content: (token_id, token)
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special and token.content in written
        }
        nonce = secrets.token_hex(16)  # a message cannot contain a marker it cannot guess
        markers = {content: f"\ue000{nonce}.{n}\ue001" for n, content in enumerate(specials)}
        self._tokenizer.add_tokens(
            [
                AddedToken(
                    markers[content],
                    single_word=token.single_word,
                    lstrip=token.lstrip,
                    rstrip=token.rstrip,
                    normalized=False,
                    special=False,
                )
                for content, (_, token) in specials.items()
            ]
        )
        self._special_ids = {
            self._tokenizer.token_to_id(markers[content]): token_id
            for content, (token_id, _) in specials.items()
        }
        self.template = _compile(_marked(template, markers))
        self.special_tokens = {k: _marked(v, markers) for k, v in special_tokens.items()}

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        [encoding] = self._tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return list(encoding.ids)

    def encode_marked(self, text: str) -> list[int]:
        """Ids of a rendered template: markers become their special tokens' ids."""
        special = self._special_ids
        return [special.get(i, i) for i in self.encode(text, add_special_tokens=False)]


def _marked(text: str, markers: Mapping[str, str]) -> str:
    """``text`` with each special token replaced by its marker (the longest first, so one
    that contains another is replaced whole)."""
    for content in sorted(markers, key=len, reverse=True):
        text = text.replace(content, markers[content])
    return text


def _compile(source: str) -> Template:
    """The Jinja environment of transformers' ``apply_chat_template``, so templates written
    for it render identically."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers 5) or the ``chat_template`` config entry
    (a string, or named templates of which "default" is used)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _token_text(token: str | Mapping[str, Any]) -> str:
    return token if isinstance(token, str) else str(token["content"])


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _generation_config_eos_ids(folder: Path) -> frozenset[int]:
    """The ``eos_token_id`` (an int or a list) of the folder's generation_config.json, if any."""
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
