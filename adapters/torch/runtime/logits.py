"""Per-row logits processing between the forward and the sampler.

Each request's ``SamplingParams`` may bias token ids (``logit_bias``), allow only some
(``allowed_token_ids``) or ban the last token of a bad word whose other tokens the output
ends with (``bad_words``, vLLM's rule), and a structured-output row gets its grammar's
bitmask (computed by :mod:`adapters.torch.runtime.structured`). Only rows that ask are
touched, and a batch where none asks returns its logits untouched (no copy).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from domain.sampling import SamplingParams


def process_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    grammar: tuple[Sequence[int], Tensor] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """``logits`` ``[B, V]`` with each row's processing applied (a new tensor when any row
    asks, else ``logits`` itself). ``grammar``: the structured-output rows and their
    bitmasks (int32 ``[rows, ceil(V / 32)]``, bit ``t`` set: token ``t`` allowed).
    ``output_ids``: each row's generated tokens so far (``bad_words``; None: none yet)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab_size = out.shape[-1]
    for i in rows:
        p = params[i]
        if p.bad_words:
            banned = banned_ids(p.bad_words, output_ids[i] if output_ids is not None else ())
            if banned:
                ids = torch.tensor([t for t in banned if t < vocab_size], dtype=torch.long)
                out[i, ids.to(out.device)] = float("-inf")
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(
                [t for t in p.allowed_token_ids if t < vocab_size],
                dtype=torch.long,
                device=out.device,
            )
            kept = out[i, allowed]
            out[i].fill_(float("-inf"))
            out[i, allowed] = kept
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=out.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype, device=out.device)
            out[i].index_add_(0, ids, bias)
    if grammar is not None:
        apply_bitmask(out, *grammar)
    return out


def banned_ids(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The ids a row may not sample next: each bad word's last id when the output ends
    with the word's other ids (vLLM's rule: only generated tokens count, not the
    prompt's)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[-prefix:]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: Tensor, rows: Sequence[int], bitmask: Tensor) -> None:
    """Sets ``logits[rows[i], t]`` to -inf where bit ``t`` of ``bitmask[i]`` is clear."""
    vocab_size = logits.shape[-1]
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    masked = logits[index].masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, masked)
