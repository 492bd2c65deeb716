"""``min_tokens``: until a request has generated that many tokens, the ids that would end it
(EOS, unless ``ignore_eos``, and its ``stop_token_ids``) are masked out of its logits row.

Its own step beside the per-row processing of :mod:`adapters.torch.runtime.logits`: the
ids to mask depend on how far the request got, and on the tokenizer's EOS ids, which the
scheduler hands over in :attr:`SchedulerOutput.eos_token_ids`.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from domain.request import Request


def ids_to_suppress(request: Request, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids ``request`` may not sample now (empty once it reached ``min_tokens``). A
    structured output's grammar decides where its document ends (once complete it allows
    only EOS), so ``min_tokens`` does not apply to it."""
    params = request.sampling_params
    if len(request.generated_token_ids) >= params.min_tokens or params.structured is not None:
        return []
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= eos_token_ids
    return sorted(ids)


def suppress_stop_tokens(
    logits: Tensor, requests: Sequence[Request], eos_token_ids: frozenset[int]
) -> Tensor:
    """``logits`` ``[B, V]`` (row i: ``requests[i]``) with each row's stop ids set to -inf
    while it is short of ``min_tokens`` (a new tensor when any row is, else ``logits``)."""
    masked = [(i, ids_to_suppress(r, eos_token_ids)) for i, r in enumerate(requests)]
    masked = [(i, ids) for i, ids in masked if ids]
    if not masked:
        return logits
    vocab_size = logits.shape[-1]
    rows = [i for i, ids in masked for t in ids if t < vocab_size]
    cols = [t for _, ids in masked for t in ids if t < vocab_size]
    out = logits.clone()
    device = out.device
    out[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    return out
