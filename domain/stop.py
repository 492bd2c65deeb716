"""Stop strings on streamed text: emit what is safe, hold back what may start a stop string."""

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string to complete in a stream of text deltas (OpenAI semantics).

    The stop string itself is not emitted (unless ``include``: then the text ends with it),
    nor anything after it. Text that could be the
    beginning of a stop string is held back until the next deltas decide; stop strings spanning
    several deltas are found. Stop strings must be non-empty (``SamplingParams`` checks).
    """

    def __init__(self, stop: Sequence[str], *, include: bool = False) -> None:
        self._stop = tuple(stop)
        self._include = include
        self._held = ""
        # The stop string that was hit (None: none yet).
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns the text safe to emit now, and whether a stop string was hit
        (:attr:`matched` then says which)."""
        text = self._held + delta
        hit = self._first_hit(text)
        if hit is not None:
            self._held = ""
            start, self.matched = hit
            end = start + len(self.matched) if self._include else start
            return text[:end], True
        safe = len(text) - self._partial_stop_length(text)
        self._held = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        """Returns the held-back text at the end of the stream (no stop string was hit)."""
        held, self._held = self._held, ""
        return held

    def _first_hit(self, text: str) -> tuple[int, str] | None:
        """Start of the stop string that completes first in ``text`` (the longest on a tie),
        and that string.

        Ordering by end rather than start keeps the result independent of how the text was cut
        into deltas: "abcd" with stops ("abcd", "c") stops at "ab" whether it arrives at once or
        character by character.
        """
        found = [(i + len(s), i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        Only positions holding a stop string's first character are tried, so a step costs
        about one scan of the held text per stop string (not one per suffix length)."""
        longest = 0
        for stop in self._stop:
            # Suffixes shorter than the stop string and longer than the best so far.
            i = text.find(stop[0], max(len(text) - len(stop) + 1, 0), len(text) - longest)
            while i != -1:
                if stop.startswith(text[i:]):  # the earliest start is the longest suffix
                    longest = len(text) - i
                    break
                i = text.find(stop[0], i + 1, len(text) - longest)
        return longest
