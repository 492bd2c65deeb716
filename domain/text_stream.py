"""One request's generated text: incremental detokenizing plus stop strings, token by token.

Used by the engine's output stage and by single-request ``generate()``, so both turn tokens
into the same text deltas.
"""

from collections.abc import Sequence

from domain.detokenizer import IncrementalDetokenizer
from domain.ports import Tokenizer
from domain.stop import StopStringMatcher


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        *,
        include_stop: bool = False,
    ) -> None:
        """``include_stop``: the stop string hit stays at the end of the text."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stop, include=include_stop)

    def push(self, token: int, *, stop_token: bool = False, last: bool = False) -> tuple[str, bool]:
        """The text delta ``token`` completes, and whether a stop string was hit (the text
        then ends before it, or with it with ``include_stop``, and the request ends with
        ``stop``).

        ``stop_token``: the token ended the request as an EOS / stop id — it has no text;
        what was held back is emitted. ``last``: the request ends with this token (length),
        so held-back text is emitted after it."""
        if stop_token:
            return self._tail(), False
        delta, hit = self._stops.feed(self._detokenizer.push(token))
        if hit:
            return delta, True
        if last:
            delta += self._tail()
        return delta, False

    @property
    def matched(self) -> str | None:
        """The stop string the text hit (None: none)."""
        return self._stops.matched

    def _tail(self) -> str:
        """Held-back text at the end: an unfinished character, a possible stop-string start."""
        text, _ = self._stops.feed(self._detokenizer.flush())
        return text + self._stops.flush()
