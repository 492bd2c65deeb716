"""Speculative decoding's drafts: what a request will probably write next, guessed from
text it has already seen, for the target model to verify in one forward.

Two proposers that need no draft model (pure Python, per request; the engine asks each
running request for at most ``num_speculative_tokens`` drafts after every step):

- ``ngram`` (prompt lookup, vLLM's and llama.cpp's): the longest n-gram ending the
  request's tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) that occurred
  before in its prompt or output; the tokens that followed its latest earlier occurrence
  are the drafts. Output that copies its prompt (code edits, quotes, JSON keys) gets long
  drafts; open text gets none.
- ``suffix`` (suffix decoding, as Arctic Inference's and vLLM's ``suffix``): the same
  lookup over the request's tokens and over the outputs of recent requests (a bounded
  shared index, so a template an agent repeats is drafted from its last use), each draft
  extended token by token while the continuation seen most often after the current
  context was seen at least ``suffix_min_count`` times in the shared index or once in the
  request's own text.

Both index incrementally: each new token costs O(prompt_lookup_max) dict updates, a
proposal O(prompt_lookup_max + drafts).

The third, ``draft_model`` (``model``: a smaller model with the target's tokenizer), runs
that model greedily for ``num_speculative_tokens`` steps on its own KV
(:class:`application.engine.speculation.DraftModel`).
"""

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's fields): ``method``, drafts per step, the n-gram
    sizes looked up; ``suffix``: the shared index's size (requests kept) and the count a
    shared continuation needs. ``min_acceptance``: a request whose drafts are accepted
    less often than this (after ``probe_tokens`` drafted) stops drafting. ``draft_model``:
    ``model`` (what ``--model`` takes) and its ``quantization`` (``--quantization``'s
    values; None: the target's rule, ``auto``)."""

    method: str = "ngram"
    model: str | None = None
    quantization: str | None = None
    # 3: on the 2-core CPU a step of 1 + 3 rows costs 1.24x a plain one, 1 + 4 rows 1.57x
    # (the 4-bit kernels take four activation rows per pass); k = 3 won 10 of 12 runs.
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_recent_requests: int = 64
    suffix_min_count: int = 2
    min_acceptance: float = 0.2
    probe_tokens: int = 32
    # vLLM's: no drafts while more requests than this run. None (the default): where the
    # runner measured what steps cost (:class:`StepCosts`, the torch runner), each step
    # drafts what those costs say pays; elsewhere always.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model: the draft model's name or path, needed by (and only "
                f"by) method 'draft_model' (method {self.method!r}, model {self.model!r})"
            )
        if self.quantization is not None and self.model is None:
            raise ValueError("speculative_config.quantization: only with a draft model")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(
                "speculative_config.prompt_lookup_min/max: 1 <= min <= max <= 64, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.suffix_recent_requests < 0 or self.suffix_min_count < 1:
            raise ValueError(
                "speculative_config.suffix_recent_requests >= 0, suffix_min_count >= 1"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0 or self.probe_tokens < 1:
            raise ValueError("speculative_config.min_acceptance in [0, 1], probe_tokens >= 1")


# A request's acceptance before it has drafted much: ``PRIOR`` worth ``PRIOR_WEIGHT`` drafts.
PRIOR, PRIOR_WEIGHT = 0.5, 4.0
# Drafts are verified only where the expected tokens per unit of time beat plain decoding
# by this much (a step's measured time varies by a few %).
MARGIN = 0.03


@dataclass(frozen=True)
class StepCosts:
    """What a step costs on this machine by its shape, as the runner measured it: ``ms[b]``
    lists ``(drafts, ms)`` for steps of ``b`` decode rows (one per sequence) and ``drafts``
    draft rows shared among them, drafts ascending from 0. Steps of more sequences than
    measured draft nothing (their cost is unknown)."""

    ms: Mapping[int, Sequence[tuple[int, float]]]
    # ratio()'s answers so far (a step plans up to k drafts per request over every running
    # one: at 64 streams 192 lookups a step, most of the planning's time)
    _ratios: dict[tuple[int, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def ratio(self, sequences: int, drafts: int) -> float:
        """A step of ``sequences`` decode rows plus ``drafts`` draft rows over one of the
        decode rows alone (:meth:`_ratio`, remembered)."""
        found = self._ratios.get((sequences, drafts))
        if found is None:
            found = self._ratios[sequences, drafts] = self._ratio(sequences, drafts)
        return found

    def _ratio(self, sequences: int, drafts: int) -> float:
        """A step of ``sequences`` decode rows plus ``drafts`` draft rows, over one of the
        decode rows alone (inf: not measured). Between measured sequence counts, the
        nearest measured below with the same share of draft rows per sequence (at least
        one: a first draft row can switch a step's kernel path); between measured draft
        counts, linear; beyond them, the last two points' slope."""
        if drafts <= 0:
            return 1.0
        below = [b for b in self.ms if b <= sequences]
        if not below or sequences > max(self.ms):
            return float("inf")
        b = max(below)
        points = self.ms[b]
        x = max(drafts * b / sequences, float(points[1][0]))
        for (x0, t0), (x1, t1) in itertools.pairwise(points):
            if x <= x1:
                return (t0 + (t1 - t0) * (x - x0) / (x1 - x0)) / points[0][1]
        (x0, t0), (x1, t1) = points[-2], points[-1]
        return (t1 + (t1 - t0) * (x - x1) / (x1 - x0)) / points[0][1]

    def breakeven(self, k: int) -> float | None:
        """The acceptance from which drafting pays at one stream (k drafts at most; None:
        none below 1 does)."""
        for step in range(1, 100):
            a = step / 100
            if plan_drafts(self, 1, [(k, a)]) != [0]:
                return a
        return None


def acceptance(drafted: int, accepted: int) -> float:
    """A request's estimated chance that its next draft is kept: its drafts' so far, from
    ``PRIOR`` at the start."""
    return (accepted + PRIOR * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)


def plan_drafts(costs: StepCosts, sequences: int, offers: Sequence[tuple[int, float]]) -> list[int]:
    """How many drafts each request verifies this step: ``offers`` ``(drafts it has,
    acceptance)`` per request, in a step of ``sequences`` decode rows. A request's i-th
    draft adds ``acceptance ** i`` expected tokens; the step takes the D likeliest drafts
    overall, D chosen for the most expected tokens per unit of measured time — none
    unless that beats plain decoding by ``MARGIN``."""
    gains = heapq.nlargest(
        sum(n for n, _ in offers),
        ((a ** (i + 1), r) for r, (n, a) in enumerate(offers) for i in range(n)),
    )
    base = max(sequences, 1)
    best, best_value, tokens = 0, 1.0 + MARGIN, float(base)
    for d, (gain, _) in enumerate(gains, start=1):
        tokens += gain
        value = tokens / base / costs.ratio(base, d)
        if value > best_value:
            best, best_value = d, value
    counts = [0] * len(offers)
    for _, r in gains[:best]:
        counts[r] += 1
    return counts


def drafting_pays(config: SpeculativeConfig, drafted: int, accepted: int) -> bool:
    """Whether a request that had ``drafted`` tokens drafted, ``accepted`` of them kept,
    drafts on: always during the probe, then while its acceptance reaches the minimum."""
    return drafted < config.probe_tokens or accepted >= config.min_acceptance * drafted


class NgramIndex:
    """Where each n-gram (n in ``[low, high]``) of a growing token list last ended."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.tokens: list[int] = []
        # n-gram -> the index just after its latest occurrence that is not the list's end
        self._next: dict[tuple[int, ...], int] = {}
        # n-gram -> the index just after its latest occurrence (the end included)
        self._last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.low, min(self.high, end) + 1):
                gram = tuple(self.tokens[end - n : end])
                previous = self._last.get(gram)
                if previous is not None:
                    self._next[gram] = previous  # an occurrence with a continuation now
                self._last[gram] = end

    def continuation(self) -> int | None:
        """Where the tokens that followed the longest n-gram ending the list (at its
        latest earlier occurrence) start; None when no ending n-gram occurred before."""
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.high, end), self.low - 1, -1):
            start = self._next.get(tuple(tokens[end - n : end]))
            if start is not None:
                return start
        return None

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the ending n-gram's latest earlier occurrence."""
        start = self.continuation()
        if start is None:
            return []
        return self.tokens[start : min(start + k, len(self.tokens))]


class SharedSuffixes:
    """Continuation counts over the outputs of recent requests: context n-gram -> counts of
    the token that followed. Bounded: the oldest request's counts leave with it."""

    def __init__(self, low: int, high: int, requests: int) -> None:
        self.low, self.high, self.capacity = low, high, requests
        self._counts: dict[tuple[int, ...], Counter[int]] = {}
        self._kept: OrderedDict[str, list[tuple[tuple[int, ...], int]]] = OrderedDict()

    def add(self, request_id: str, tokens: Sequence[int]) -> None:
        """Index a finished request's output (its context n-grams and what followed)."""
        if self.capacity == 0 or request_id in self._kept:
            return
        pairs = []
        for i in range(1, len(tokens)):
            for n in range(self.low, min(self.high, i) + 1):
                pairs.append((tuple(tokens[i - n : i]), tokens[i]))
        for gram, token in pairs:
            self._counts.setdefault(gram, Counter())[token] += 1
        self._kept[request_id] = pairs
        while len(self._kept) > self.capacity:
            _, old = self._kept.popitem(last=False)
            for gram, token in old:
                counts = self._counts[gram]
                counts[token] -= 1
                if counts[token] <= 0:
                    del counts[token]
                if not counts:
                    del self._counts[gram]

    def next_token(self, context: Sequence[int], min_count: int) -> int | None:
        """The token seen most often after the longest known n-gram ending ``context``,
        when seen at least ``min_count`` times."""
        for n in range(min(self.high, len(context)), self.low - 1, -1):
            counts = self._counts.get(tuple(context[len(context) - n :]))
            if counts:
                token, count = counts.most_common(1)[0]
                return token if count >= min_count else None
        return None


class Proposer:
    """One request's drafts (``config.method``), its acceptance, and whether it still
    drafts. ``shared``: the suffix method's index of recent requests (None: ngram)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        prompt: Sequence[int],
        shared: SharedSuffixes | None = None,
    ) -> None:
        self.config, self.shared = config, shared
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.index.extend(prompt)
        self.drafted = self.accepted = 0

    @property
    def active(self) -> bool:
        """Drafting pays: too few accepted after the probe stops it for this request."""
        return drafting_pays(self.config, self.drafted, self.accepted)

    def extend(self, tokens: Sequence[int]) -> None:
        """The request's new tokens (accepted drafts and the step's own)."""
        self.index.extend(tokens)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def propose(self, k: int, *, gated: bool = True) -> list[int]:
        """Up to ``k`` drafts (none when inactive, unless not ``gated``: the step's
        measured costs decide instead)."""
        if k <= 0 or (gated and not self.active):
            return []
        drafts = self.index.propose(k)
        if self.shared is None or len(drafts) >= k:
            return drafts
        # suffix: extend (or start) with continuations seen across recent requests
        context = [*self.index.tokens[-self.config.prompt_lookup_max :], *drafts]
        while len(drafts) < k:
            token = self.shared.next_token(context, self.config.suffix_min_count)
            if token is None:
                break
            drafts.append(token)
            context.append(token)
        return drafts
