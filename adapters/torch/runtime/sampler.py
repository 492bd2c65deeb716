"""Batched sampling: one call picks the next token of every row, each with its own parameters.

Pipeline per row (HF order): penalties -> top-k -> temperature -> softmax -> top-p -> min-p ->
inverse-CDF draw. Greedy rows are argmax; in a mixed batch they ride the same pipeline as
"top-k 1, draw 0", which keeps the lowest id among tied maxima.

Every step is row-local and order-free (thresholds, no sorts), so a row with its own
generator gets the same token whichever rows share its batch. At most one device->host
transfer per call: everything the host needs is packed into one tensor before ``tolist()``.
On CPUs with the compiled kernels, everything after the penalties runs as one
``sample_rows`` call with the same arithmetic (~20 passes over ``[B, V]`` tensors cost a
decode step or two at batch 64).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adapters.torch.cpu.kernels import cpu_kernels, for_bf16_cpu
from domain.sampling import SamplingParams

# Probabilities as integers (units of 2**-40): exact, order-independent sums, so the nucleus and
# the CDF come out the same on every device and batch; the truncated tail (< 1e-12) never wins.
_FIXED_POINT = 2.0**40
# Radix-select digit widths over the 31 magnitude bits of a non-negative float32.
_RADIX_WIDTHS = (11, 10, 10)


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """Per row: the chosen id; when any row asked, its logprob and the top-N alternatives.

    Logprobs come from the distribution each row's ``params.logprobs_mode`` names (see
    :class:`SamplingParams`): ``processed``, the one sampled from (log-softmax of the
    processed, penalized logits divided by the temperature, greedy rows undivided, before
    the top-k / top-p / min-p truncation), or ``raw``, the model's. ``top_logprobs`` rows
    hold ``params.logprobs`` pairs, best first, and are empty for rows that asked for none.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream, on the device its logits live on."""
    return torch.Generator(device=device).manual_seed(seed)


class TokenSampler:
    """Samples a whole batch in one call, each row with its own :class:`SamplingParams`."""

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        *,
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        raw_logits: Tensor | None = None,
    ) -> SampledTokens:
        """``logits`` ``[B, V]`` (any float dtype); the other arguments have one entry per row.

        ``generators[i]`` is row i's own generator (seeded requests) or ``None`` (global RNG).
        ``raw_logits``: the model's logits before per-row processing (bias, masks), which
        ``raw``-mode logprobs come from; None: ``logits`` are the model's own.
        """
        raw = logits if raw_logits is None else raw_logits
        assert logits.shape[0] == len(params) == len(prompt_ids) == len(output_ids)
        assert len(generators) == len(params)
        if all(p.greedy and not p.has_penalties for p in params):
            return _collect(_argmax(logits), _scored(raw, logits, params), params)
        penalized = (
            _penalize_rows(logits.float(), params, prompt_ids, output_ids)
            if any(p.has_penalties for p in params)
            else logits
        )
        if all(p.greedy for p in params):
            token_ids = penalized.argmax(dim=-1)
        else:
            uniforms = _uniforms(params, generators, logits.device)
            kernels = cpu_kernels() if logits.device.type == "cpu" else None
            if kernels is not None and penalized.dtype in (torch.float32, torch.bfloat16):
                token_ids = _sample_rows(kernels, penalized, params, uniforms)
            else:
                token_ids = sample_from_probs(filtered_probs(penalized.float(), params), uniforms)
        return _collect(token_ids, _scored(raw, penalized, params), params)


def _scored(raw: Tensor, processed: Tensor, params: Sequence[SamplingParams]) -> Tensor | None:
    """``[B, V]`` logits whose log-softmax each row reports: ``processed`` (after per-row
    processing and penalties) divided by the row's temperature (1 for greedy rows) in
    ``processed`` mode, ``raw`` in ``raw`` mode; None when no row asked for logprobs."""
    if all(p.logprobs is None for p in params):
        return None
    if all(p.logprobs_mode == "raw" for p in params):
        return raw
    temperature = _row_values([1.0 if p.greedy else p.temperature for p in params], processed)
    scored = processed.float() / temperature[:, None]
    if all(p.logprobs_mode == "processed" for p in params):
        return scored
    is_raw = torch.tensor([p.logprobs_mode == "raw" for p in params], device=raw.device)
    return torch.where(is_raw[:, None], raw.float(), scored)


def filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``[B, V]`` float32 logits -> ``[B, V]`` unnormalized probabilities after every filter.

    Greedy rows keep only their maximal logits (top-k 1 at temperature 1). Each filter runs
    only when some row uses it.
    """
    vocab_size = logits.shape[-1]
    top_k = [1 if p.greedy else p.top_k for p in params]
    if any(0 < k < vocab_size for k in top_k):
        logits = apply_top_k(logits, top_k)
    temperature = _row_values([1.0 if p.greedy else p.temperature for p in params], logits)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    top_p = [1.0 if p.greedy else p.top_p for p in params]
    if any(q < 1.0 for q in top_p):
        probs = apply_top_p(probs, top_p)
    min_p = [0.0 if p.greedy else p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = apply_min_p(probs, min_p)
    return probs


def apply_penalties(
    logits: Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> Tensor:
    """``[B, V]`` logits with per-row penalties applied; ``logits`` itself is left untouched.

    Repetition (HF): a token seen in prompt or output has its logit divided by the penalty if
    positive, multiplied if not. Presence and frequency (OpenAI), over output tokens only:
    ``logit -= presence * (count > 0) + frequency * count``.
    """
    vocab_size = logits.shape[-1]
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)  # touched only where a row's tokens are: [row * V + id]
    if any(r != 1.0 for r in repetition):
        seen = _flat_ids(
            [[*p, *o] for p, o in zip(prompt_ids, output_ids, strict=True)], vocab_size, out.device
        ).unique()
        scale = _row_values(repetition, out)[seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / scale, values * scale)
    if any(presence) or any(frequency):
        ids, counts = _flat_ids(output_ids, vocab_size, out.device).unique(return_counts=True)
        rows = ids // vocab_size
        penalty = _row_values(presence, out)[rows] + _row_values(frequency, out)[rows] * counts
        flat[ids] -= penalty
    return out


def _flat_ids(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """``row * vocab_size + id`` for every id of every row of ``token_ids`` (int64)."""
    flat = [row * vocab_size + t for row, ids in enumerate(token_ids) for t in ids]
    return torch.tensor(flat, dtype=torch.long, device=device)


def apply_top_k(logits: Tensor, top_k: Sequence[int]) -> Tensor:
    """``[B, V]`` logits with everything below each row's k-th largest value set to -inf.

    ``top_k[i] <= 0`` disables row i. Ties with the k-th value are kept, so the result depends
    on values only, never on how a sort orders equal logits (bf16 logits tie often).
    """
    vocab_size = logits.shape[-1]
    enabled = [0 < k < vocab_size for k in top_k]
    ks = [k if on else 1 for k, on in zip(top_k, enabled, strict=True)]
    kth_index = torch.tensor([k - 1 for k in ks], device=logits.device)[:, None]
    kth = logits.topk(max(ks), dim=-1).values.gather(1, kth_index)
    on = torch.tensor(enabled, device=logits.device)[:, None]
    return logits.masked_fill(on & (logits < kth), float("-inf"))


def apply_top_p(probs: Tensor, top_p: Sequence[float]) -> Tensor:
    """``[B, V]`` float32 probabilities with tokens outside each row's nucleus set to 0.

    The nucleus is the most probable tokens whose mass first reaches ``top_p`` of the row's
    total (the top token always stays; ties at the boundary all stay). ``top_p[i] == 1``
    disables row i.
    """
    top_p_rows = torch.tensor(top_p, dtype=torch.float64, device=probs.device)
    enabled = torch.tensor([p < 1.0 for p in top_p], device=probs.device)[:, None]
    threshold = _nucleus_threshold(probs, top_p_rows).masked_fill(~enabled, 0)
    return probs.masked_fill(probs.view(torch.int32) < threshold, 0.0)


def _nucleus_threshold(probs: Tensor, top_p: Tensor) -> Tensor:
    """``[B, 1]`` int32 bit pattern of each row's smallest kept probability.

    A radix select instead of a sort (a 49152-wide ``torch.sort`` costs milliseconds on a
    CPU): non-negative float32 values order like their int32 bit patterns, so the threshold
    is found digit by digit from per-row histograms of probability mass, most significant
    digit first. Per digit the bins are: 0 below the prefix found so far, 1 + digit inside
    it, last above it; the chosen digit is the largest whose mass from it upward reaches
    ``top_p`` of the total. ``probs`` ``[B, V]``, ``top_p`` ``[B]`` float64.
    """
    bits = probs.view(torch.int32)
    weights = (probs * _FIXED_POINT).long()
    target = top_p[:, None] * weights.sum(dim=-1, keepdim=True)
    prefix = torch.zeros_like(bits[:, :1])
    shift = 31
    for width in _RADIX_WIDTHS:
        shift -= width
        bins = ((bits >> shift) - ((prefix << width) - 1)).clamp_(0, (1 << width) + 1).long()
        hist = weights.new_zeros(bits.shape[0], (1 << width) + 2).scatter_add_(1, bins, weights)
        mass_from = hist.flip(-1).cumsum(dim=-1).flip(-1)
        digit = (mass_from >= target).sum(dim=-1, keepdim=True, dtype=torch.int32) - 2
        prefix = (prefix << width) + digit
    return prefix


def apply_min_p(probs: Tensor, min_p: Sequence[float]) -> Tensor:
    """``[B, V]`` probabilities with tokens below ``min_p`` times the row's maximum set to 0."""
    floor = _row_values(min_p, probs)[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < floor, 0.0)


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """``[B]`` int64 ids drawn by inverse CDF from ``[B, V]`` filtered probabilities.

    Rows need not sum to 1 (filters zero tokens without renormalizing), only to at most 1.

    ``uniforms`` ``[B]`` float64 in ``[0, 1)``; 0 picks the lowest-id kept token. One uniform
    per row, not V exponentials for an exponential race (~1 ms per 49152-wide row on a CPU),
    and a row's generator advances the same whatever the batch.
    """
    return draw_from_probs(probs, uniforms[:, None]).squeeze(1)


def draw_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """``[B, N]`` int64 ids: N inverse-CDF draws per row of ``[B, V]`` probabilities (as
    :func:`sample_from_probs`), one per float64 uniform of ``uniforms`` ``[B, N]``."""
    cdf = (probs * _FIXED_POINT).long().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum((uniforms * total).long(), total - 1)
    return torch.searchsorted(cdf, target, right=True)


def _penalize_rows(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> Tensor:
    """``[B, V]`` logits with :func:`apply_penalties` run on only the rows that have any."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    index = torch.tensor(rows, device=logits.device)
    penalized = apply_penalties(
        logits.index_select(0, index),
        [prompt_ids[i] for i in rows],
        [output_ids[i] for i in rows],
        [params[i].repetition_penalty for i in rows],
        [params[i].presence_penalty for i in rows],
        [params[i].frequency_penalty for i in rows],
    )
    return logits.index_copy(0, index, penalized)


def _uniforms(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> Tensor:
    """``[B]`` float64: one draw per row from its own generator (or the global one); greedy 0."""
    if all(g is None for g in generators):
        draws = torch.rand(len(params), dtype=torch.float64, device=device)
    else:
        draws = torch.cat(
            [torch.rand(1, dtype=torch.float64, device=device, generator=g) for g in generators]
        )
    sampled = torch.tensor([not p.greedy for p in params], device=device)
    return draws * sampled


def _sample_rows(
    kernels: Any, logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor
) -> Tensor:
    """The whole pipeline of :func:`filtered_probs` + :func:`sample_from_probs` as one CPU
    kernel call (one row per thread at a time instead of ~20 passes over ``[B, V]``)."""
    vocab_size = logits.shape[-1]
    return kernels.sample_rows(
        logits.contiguous(),
        _row_values([0.0 if p.greedy else p.temperature for p in params], logits),
        torch.tensor([p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]),
        _row_values([p.top_p for p in params], logits),
        _row_values([p.min_p for p in params], logits),
        uniforms,
    )


def _argmax(logits: Tensor) -> Tensor:
    """``[B]`` argmax of ``[B, V]`` logits as they are (no float32 copy: it would order bf16
    values the same), by the CPU kernel for bf16 where it exists (PyTorch's is scalar)."""
    kernels = for_bf16_cpu(logits)
    if kernels is not None and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _row_values(values: Sequence[float], like: Tensor) -> Tensor:
    """``[B]`` float32 on ``like``'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _collect(
    token_ids: Tensor, scored: Tensor | None, params: Sequence[SamplingParams]
) -> SampledTokens:
    """Bring ids ``[B]`` (and, if asked, logprobs of the logits ``scored`` ``[B, V]``,
    computed in float32) to the host at once."""
    wanted = [p.logprobs for p in params]
    if scored is None:
        return SampledTokens(token_ids.tolist(), None, None)
    logprobs = torch.log_softmax(scored.float(), dim=-1)
    n_max = max(n or 0 for n in wanted)
    top = logprobs.topk(n_max, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    # float64 holds every vocabulary id exactly, so one tensor carries ids and logprobs.
    columns = [token_ids[:, None], chosen, top.indices, top.values]
    rows = torch.cat([c.double() for c in columns], dim=1).tolist()
    return SampledTokens(
        token_ids=[int(row[0]) for row in rows],
        logprobs=[row[1] for row in rows],
        top_logprobs=[
            _top_pairs(row[2:], n_max, n or 0) for row, n in zip(rows, wanted, strict=True)
        ],
    )


def _top_pairs(columns: list[float], n_max: int, n: int) -> list[tuple[int, float]]:
    """The first ``n`` of ``n_max`` ids followed by ``n_max`` logprobs, as (id, logprob) pairs."""
    return [(int(columns[j]), columns[n_max + j]) for j in range(n)]
