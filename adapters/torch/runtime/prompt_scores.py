"""Prompt scores: what a prefill's logits at prompt positions tell the requests that ask.

Per request and prompt position (the row whose logits predict the next prompt token): the
next token's logprob (``prompt_logprobs``) and rank (``prompt_ranks``: 1 + the ids more
likely), the top-N alternatives (``prompt_top_logprobs``), the logprobs of chosen ids
(``prompt_target_ids``), and N tokens drawn at the request's temperature
(``prompt_samples``). All are the model's own
logprobs (log-softmax of the logits in float32), from the same logits the step computed.

A draw is an inverse-CDF pick (:func:`draw_from_probs`) with a uniform that is a function
of the request's seed, the position and the draw's index alone (splitmix64 over a
counter), so a seeded request draws the same tokens however its prompt is chunked into
steps, and draw ``j`` of a position is the same whatever the number of draws.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from adapters.torch.runtime.sampler import draw_from_probs
from domain.sampling import SamplingParams

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_DRAW_ROWS = 512  # rows drawn at once: bounds the [rows, V] probabilities and CDF


@dataclass(frozen=True, slots=True)
class ScoredSpan:
    """``count`` consecutive logits rows of one request's prompt chunk; the first predicts
    prompt position ``start + 1``."""

    request_id: str
    start: int
    count: int
    params: SamplingParams


@dataclass
class PromptScores:
    """Per request id, one entry per scored position (as ``RunnerOutput`` holds them)."""

    logprobs: dict[str, list[float]] = field(default_factory=dict)
    top: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    targets: dict[str, list[list[float]]] = field(default_factory=dict)
    samples: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)


def score_prompts(logits: Tensor, targets: list[int], spans: Sequence[ScoredSpan]) -> PromptScores:
    """``logits`` ``[sum(counts), V]``: the spans' rows in order; ``targets``: each row's
    next prompt token."""
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    flat = logprobs.gather(1, index[:, None])[:, 0].tolist()
    k_max = max(s.params.prompt_top_logprobs for s in spans)
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    if k_max:
        top = logprobs.topk(k_max, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    scores = PromptScores()
    at = 0
    for span in spans:
        rid, count, k = span.request_id, span.count, span.params.prompt_top_logprobs
        scores.logprobs[rid] = flat[at : at + count]
        if span.params.prompt_ranks:
            rows = logprobs[at : at + count]
            chosen = rows.gather(1, index[at : at + count, None])
            scores.ranks[rid] = ((rows > chosen).sum(dim=-1) + 1).tolist()
        if k:
            scores.top[rid] = [
                list(zip(top_ids[r][:k], top_values[r][:k], strict=True))
                for r in range(at, at + count)
            ]
        if span.params.prompt_samples:
            scores.samples[rid] = _draws(logits[at : at + count], logprobs[at : at + count], span)
        at += count
    scores.targets = _target_logprobs(logprobs, spans)
    return scores


def _target_logprobs(logprobs: Tensor, spans: Sequence[ScoredSpan]) -> dict[str, list[list[float]]]:
    """Per span with ``prompt_target_ids``: each row's ids' logprobs, in the ids' order
    (one gather for every span)."""
    rows: list[int] = []
    ids: list[int] = []
    at = 0
    for span in spans:
        table = span.params.prompt_target_ids
        if table is not None:
            for r in range(span.count):
                row = table[span.start + r] if span.start + r < len(table) else ()
                rows.extend([at + r] * len(row))
                ids.extend(row)
        at += span.count
    if not any(s.params.prompt_target_ids is not None for s in spans):
        return {}
    device = logprobs.device
    at_rows = torch.tensor(rows, dtype=torch.long, device=device)
    flat = logprobs[at_rows, torch.tensor(ids, dtype=torch.long, device=device)].tolist()
    out: dict[str, list[list[float]]] = {}
    taken = 0
    for span in spans:
        table = span.params.prompt_target_ids
        if table is None:
            continue
        per_row = []
        for r in range(span.count):
            n = len(table[span.start + r]) if span.start + r < len(table) else 0
            per_row.append(flat[taken : taken + n])
            taken += n
        out[span.request_id] = per_row
    return out


def _draws(logits: Tensor, logprobs: Tensor, span: ScoredSpan) -> list[list[tuple[int, float]]]:
    """``span.params.prompt_samples`` draws per row of ``logits`` (its span's), each with
    its logprob under ``logprobs``."""
    params, k = span.params, span.params.prompt_samples
    key = params.seed if params.seed is not None else random.getrandbits(64)
    picked = []
    for begin in range(0, span.count, _DRAW_ROWS):
        rows = logits[begin : begin + _DRAW_ROWS].float()
        if params.greedy:
            ids = rows.argmax(dim=-1, keepdim=True).expand(-1, k)
        else:
            probs = torch.softmax(rows / params.temperature, dim=-1)
            first = span.start + begin
            uniforms = position_uniforms(key, first, rows.shape[0], k)
            ids = draw_from_probs(probs, torch.from_numpy(uniforms).to(rows.device))
        values = logprobs[begin : begin + _DRAW_ROWS].gather(1, ids)
        picked.append(torch.stack([ids.double(), values.double()], dim=-1))
    pairs = torch.cat(picked).tolist()  # float64 holds every id exactly
    return [[(int(i), v) for i, v in row] for row in pairs]


def position_uniforms(seed: int, start: int, count: int, k: int) -> np.ndarray:
    """``[count, k]`` float64 in ``[0, 1)``: draw ``j`` of rows ``start`` .. ``start +
    count - 1``, a function of (``seed``, row, ``j``) alone: splitmix64's output for the
    counter ``row * 256 + j`` of the stream ``seed`` starts (``k`` <= 256)."""
    assert k <= 256
    base = _mix(np.array([seed % 2**64], dtype=np.uint64) + _GOLDEN)
    rows = np.arange(start, start + count, dtype=np.uint64)[:, None] << np.uint64(8)
    counters = rows | np.arange(k, dtype=np.uint64)[None, :]
    bits = _mix(base + (counters + np.uint64(1)) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
