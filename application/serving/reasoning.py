"""Reasoning output: a thinking model's thinking split from its answer.

Qwen3 and DeepSeek-R1 style models think in ``<think> … </think>`` before they answer.
Every face shows the two apart: chat's ``message.reasoning_content`` (and vLLM's
``reasoning``) and its streamed deltas, reasoning items in Responses, ``thinking`` blocks in
Messages. Tool calls and structured outputs apply to the answer only.

Where the thinking starts is read from the rendered prompt, not guessed from the output:
a template that opens the assistant's turn with ``<think>`` (DeepSeek-R1, Qwen3's thinking
releases) has the output start inside the thinking; otherwise (Qwen3 hybrid models) it
starts there when the output begins with ``<think>``. A prompt that already holds a closed
``<think></think>`` (Qwen3 with ``enable_thinking: false``) gets an answer only. Thinking
cut by ``max_tokens`` before ``</think>`` is all thinking.

The parser is chosen by the chat template (one that writes ``<think>`` gets the ``think``
parser) or by ``--reasoning-parser`` (``none`` turns it off: the thinking stays in the
content, as before).
"""

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "think", "qwen3", "deepseek_r1", "none")  # --reasoning-parser's values


@dataclass(frozen=True, slots=True)
class Split:
    """A piece of output: what of it is thinking, what is the answer."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's output splits: ``starts_inside``: the prompt opened the thinking
    (the output starts in it, no ``<think>`` of its own)."""

    starts_inside: bool = False

    def stream(self) -> "ReasoningStream":
        """A splitter for one choice's streamed text."""
        return ReasoningStream(self.starts_inside)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (thinking, answer): thinking None when the model did not
        think; both stripped of the whitespace around the tags."""
        stream = self.stream()
        whole = stream.feed(text)
        rest = stream.finish()
        reasoning, content = whole.reasoning + rest.reasoning, whole.content + rest.content
        return (reasoning.strip() if stream.thought else None), content


def closes_thinking(prompt_text: str) -> bool:
    """The prompt ends after a closed ``<think></think>`` (Qwen3's ``enable_thinking:
    false``): the model answers at once."""
    return prompt_text.rfind(CLOSE) > prompt_text.rfind(OPEN)


def reasoning_for(prompt_text: str, parser: str) -> Reasoning | None:
    """The split of a request whose rendered prompt ends with ``prompt_text`` (its last
    few hundred characters suffice), under the server's ``parser`` (``think``, or None:
    no parser)."""
    if parser == "none":
        return None
    opened, closed = prompt_text.rfind(OPEN), prompt_text.rfind(CLOSE)
    return Reasoning(starts_inside=opened > closed)


def parser_for(template: str | None, choice: str = "auto") -> str:
    """The parser a server runs: ``choice`` (``--reasoning-parser``), where ``auto`` means
    ``think`` for a template that writes ``<think>`` and ``none`` otherwise. qwen3 and
    deepseek_r1 are vLLM's names for the same ``<think>`` parsing here (where the thinking
    starts is read from each prompt)."""
    if choice not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {choice!r}")
    if choice == "auto":
        return "think" if template is not None and OPEN in template else "none"
    return "none" if choice == "none" else "think"


class ReasoningStream:
    """One choice's text deltas split into thinking and answer deltas. A tag split across
    deltas is held back until it is known; whitespace right after ``<think>`` and around
    ``</think>`` is dropped (it is the template's, not the model's words)."""

    def __init__(self, starts_inside: bool) -> None:
        self._inside = starts_inside
        self.thought = starts_inside  # whether any thinking was seen
        self._pending = ""  # text that may be the start of a tag
        self._at_start = True  # nothing of the output decided yet
        self._strip = starts_inside  # drop leading whitespace of the next part

    def feed(self, text: str) -> Split:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._at_start and not self._inside:
                head = self._pending.lstrip()
                if not head:
                    return self._joined(reasoning, content)  # only whitespace yet
                if head.startswith(OPEN):
                    self._pending = head[len(OPEN) :]
                    self._inside = self.thought = self._strip = True
                    self._at_start = False
                    continue
                if OPEN.startswith(head):
                    return self._joined(reasoning, content)  # could still be <think>
                self._at_start = False
            if not self._inside:
                content.append(self._take_stripped(self._pending))
                self._pending = ""
                break
            self._at_start = False
            end = self._pending.find(CLOSE)
            if end >= 0:
                reasoning.append(self._take_stripped(self._pending[:end].rstrip()))
                self._pending = self._pending[end + len(CLOSE) :]
                self._inside, self._strip = False, True
                continue
            keep = _partial_tag(self._pending, CLOSE)
            safe = self._pending[: len(self._pending) - keep]
            # whitespace before a possible </think> is held back too (it is dropped there)
            held = len(safe) - len(safe.rstrip())
            reasoning.append(self._take_stripped(safe[: len(safe) - held]))
            self._pending = self._pending[len(safe) - held :]
            break
        return self._joined(reasoning, content)

    def finish(self) -> Split:
        """What was held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._inside:
            return Split(reasoning=self._take_stripped(pending.rstrip()))
        return Split(content=self._take_stripped(pending))

    def _take_stripped(self, text: str) -> str:
        if self._strip:
            stripped = text.lstrip()
            if stripped:
                self._strip = False
            return stripped
        return text

    @staticmethod
    def _joined(reasoning: list[str], content: list[str]) -> Split:
        return Split("".join(reasoning), "".join(content))


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
