"""IncrementalDetokenizer with the byte-level fake and a SentencePiece-like stand-in."""

from collections.abc import Sequence

from adapters.fake import ByteTokenizer
from adapters.fake.tokenizer import EOS_ID
from domain.detokenizer import IncrementalDetokenizer

TOKENIZER = ByteTokenizer()


def _stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int]) -> list[str]:
    return [detokenizer.push(token_id) for token_id in token_ids]


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_holds_back_a_partial_emoji_until_its_last_byte() -> None:
    assert _stream(IncrementalDetokenizer(TOKENIZER), _ids("👋")) == ["", "", "", "👋"]


def test_emits_ascii_one_token_at_a_time() -> None:
    assert _stream(IncrementalDetokenizer(TOKENIZER), _ids("hi!")) == ["h", "i", "!"]


def test_deltas_concatenate_to_the_decoded_text() -> None:
    text = "naïve 你好 👨‍👩‍👧 done"
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    deltas = _stream(detokenizer, _ids(text))
    assert "".join(deltas) + detokenizer.flush() == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_flush_returns_an_unfinished_character_as_the_decoder_does() -> None:
    token_ids = _ids("ok👋")[:-1]
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    assert "".join(_stream(detokenizer, token_ids)) == "ok"
    assert detokenizer.flush() == TOKENIZER.decode(token_ids)[2:] == "\ufffd"
    assert detokenizer.flush() == ""


def test_skips_special_tokens_unless_told_not_to() -> None:
    token_ids = [*_ids("a"), EOS_ID]
    assert _stream(IncrementalDetokenizer(TOKENIZER), token_ids) == ["a", ""]
    kept = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False)
    assert _stream(kept, token_ids) == ["a", "<eos>"]


def test_never_emits_the_prompt() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("a long prompt"))
    assert "".join(_stream(detokenizer, _ids(" and more"))) == " and more"


def test_decodes_a_bounded_window_however_long_the_text() -> None:
    recorder = _RecordingTokenizer()
    _stream(IncrementalDetokenizer(recorder, _ids("prompt" * 100)), _ids("ab👋" * 500))
    assert max(recorder.decoded_lengths) <= 10


def test_keeps_a_sentencepiece_leading_space_after_the_prompt() -> None:
    tokenizer = _SentencePieceLike(["▁Hello", "▁world", "!"])
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[0])
    assert _stream(detokenizer, [1, 2]) == [" world", "!"]


def test_matches_sentencepiece_decode_without_a_prompt() -> None:
    tokenizer = _SentencePieceLike(["▁Hello", "▁world", "!"])
    deltas = _stream(IncrementalDetokenizer(tokenizer), [0, 1, 1, 2])
    assert deltas == ["Hello", " world", " world", "!"]
    assert "".join(deltas) == tokenizer.decode([0, 1, 1, 2])


class _RecordingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(token_ids))
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens)


class _SentencePieceLike(ByteTokenizer):
    """Word pieces where "▁" marks a space, dropped at the start of a sequence (Llama 2 style)."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = pieces

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(self._pieces[i] for i in token_ids).replace("▁", " ").removeprefix(" ")
