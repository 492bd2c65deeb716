"""Per-row logits processing between the forward and the sampler.

Each request's ``SamplingParams`` may bias token ids (``logit_bias``) or allow only some
(``allowed_token_ids``); later, grammar masks for structured output join here. Only rows
that ask are touched, and a batch where none asks returns its logits untouched (no copy).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from domain.sampling import SamplingParams


def process_logits(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``logits`` ``[B, V]`` with each row's processing applied (a new tensor when any row
    asks, else ``logits`` itself)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab_size = out.shape[-1]
    for i in rows:
        p = params[i]
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
    return out
