"""The training forward: a batch's data checked into tensors, grouped into micro-batches of
about ``TOKENS_PER_MICRO_BATCH`` tokens (data sharing a long prefix packed to compute it
once), and each target token's logprob under the model with its adapters, the logits
computed in chunks."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from adapters.torch.models.config import ModelConfig
from adapters.torch.models.transformer import Transformer
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import (
    LOSS_INPUTS,
    Datum,
    TensorValue,
)

# Padded tokens per training micro-batch.
TOKENS_PER_MICRO_BATCH = 2048
# Logits of at most this many rows at once; with gradients, more than LOGIT_ELEMENTS logits
# (256 MB in float32) are recomputed per chunk in the backward pass instead of kept.
LOGIT_CHUNK_ROWS = 1024
LOGIT_ELEMENTS = 1 << 26
# Shared-prefix packing: data whose token ids begin alike for at least MIN_SHARED_PREFIX
# tokens run as one sequence (the prefix once, then each datum's own tokens) when that is
# at most PACKED_FRACTION of their tokens side by side (see ``shared_prefix_packs``).
MIN_SHARED_PREFIX = 16
PACKED_FRACTION = 0.75


@dataclass(frozen=True)
class Prepared:
    tokens: Tensor  # [T] int64
    targets: Tensor  # [T] int64
    inputs: dict[str, Tensor]  # loss input name -> [T] float32 (target_tokens as int64)


def prepare(config: ModelConfig, index: int, datum: Datum, loss_fn: str) -> Prepared:
    """Checked tensors for one datum; bad input raises naming the datum and the key."""
    where = f"data[{index}]"
    length = len(datum.tokens)
    if length == 0:
        raise InvalidTrainingRequest(f"{where}.model_input: no tokens")
    if length > config.max_position_embeddings:
        raise InvalidTrainingRequest(
            f"{where}.model_input: {length} tokens exceed the model's context of "
            f"{config.max_position_embeddings}"
        )
    tokens = torch.tensor(list(datum.tokens), dtype=torch.int64)
    check_token_ids(tokens, config.vocab_size, f"{where}.model_input")
    inputs = {}
    for key in LOSS_INPUTS[loss_fn]:
        value = datum.loss_fn_inputs.get(key)
        if value is None and key == "weights":  # cross_entropy's weights default to 1
            inputs[key] = torch.ones(length)
            continue
        if value is None:
            needed = ", ".join(LOSS_INPUTS[loss_fn])
            raise InvalidTrainingRequest(
                f"{where}.loss_fn_inputs: missing {key!r} ({loss_fn} needs {needed})"
            )
        if value.shape != (length,) or len(value.data) != length:
            raise InvalidTrainingRequest(
                f"{where}.loss_fn_inputs[{key!r}]: shape {list(value.shape)}, "
                f"expected [{length}] (one per input token)"
            )
        inputs[key] = to_tensor(value, key, where)
    targets = inputs["target_tokens"]
    check_token_ids(targets, config.vocab_size, f"{where}.loss_fn_inputs['target_tokens']")
    return Prepared(tokens, targets, inputs)


def to_tensor(value: TensorValue, key: str, where: str) -> Tensor:
    if key == "target_tokens":
        if value.dtype != "int64":
            raise InvalidTrainingRequest(f"{where}.loss_fn_inputs['target_tokens']: must be int64")
        return torch.tensor(value.data.tolist(), dtype=torch.int64)
    return torch.tensor(value.data.tolist(), dtype=torch.float32)


def check_token_ids(ids: Tensor, vocab: int, where: str) -> None:
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        raise InvalidTrainingRequest(
            f"{where}: token id {int(ids[bad][0])} out of range [0, {vocab})"
        )


@dataclass(frozen=True)
class Pack:
    """The next ``size`` data of a micro-batch, which share their first ``prefix`` tokens:
    run as one sequence, the prefix once, then each datum's remaining tokens."""

    size: int
    prefix: int


def micro_batches(data: Sequence[Prepared]) -> Iterator[tuple[list[int], list[Pack]]]:
    """Indices of ``data`` in micro-batches, each with its packs (none: the data
    right-padded side by side). Packs (``shared_prefix_packs``) go together by similar
    packed length, their packed tokens within ``TOKENS_PER_MICRO_BATCH``; the other data
    by similar length, their padded size (rows times the longest) within it. A longer pack
    or datum goes alone."""
    packs, alone = shared_prefix_packs(data)
    sizes = [prefix + sum(len(data[i].tokens) - prefix for i in m) for m, prefix in packs]
    for group in by_size(sizes, padded=False):
        indices = [i for g in group for i in packs[g][0]]
        yield indices, [Pack(len(packs[g][0]), packs[g][1]) for g in group]
    for group in by_size([len(data[i].tokens) for i in alone]):
        yield [alone[g] for g in group], []


def by_size(sizes: Sequence[int], *, padded: bool = True) -> Iterator[list[int]]:
    """Indices of ``sizes`` grouped by similar size, each group's count times its largest
    (``padded``; else its sum) within ``TOKENS_PER_MICRO_BATCH`` (a larger one goes
    alone)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    group: list[int] = []
    total = 0
    for i in order:
        # Ascending sizes: the newest is the group's largest.
        cost = (len(group) + 1) * sizes[i] if padded else total + sizes[i]
        if group and cost > TOKENS_PER_MICRO_BATCH:
            yield group
            group, total = [], 0
        group.append(i)
        total += sizes[i]
    if group:
        yield group


# Runs of at most this many data (bounds the dynamic programming's work).
MAX_RUN = 256


def shared_prefix_packs(
    data: Sequence[Prepared],
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """The data to pack, as (indices, shared prefix length), and the data that go alone.

    Sorted by token ids, data sharing a prefix are neighbours; the runs of that order that
    share at least ``MIN_SHARED_PREFIX`` tokens and save the most prefix tokens in all
    (``(members - 1) * prefix`` each) are chosen by dynamic programming, then cut into
    packs of at most ``TOKENS_PER_MICRO_BATCH`` tokens (or the run's longest datum). A
    pack of two or more data whose packed tokens are at most ``PACKED_FRACTION`` of theirs
    is kept; the others' data go alone."""
    ids = [d.tokens.tolist() for d in data]
    order = sorted(range(len(data)), key=ids.__getitem__)
    # common[k]: the tokens order[k - 1] and order[k] share (a run shares its minimum).
    common = [0] + [common_prefix(ids[a], ids[b]) for a, b in pairwise(order)]
    best, start = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # the best runs of order[:j]; the last from start[j]
        best[j], start[j] = best[j - 1], j - 1
        shared = len(ids[order[j - 1]])
        for i in range(j - 2, max(-1, j - 2 - MAX_RUN), -1):  # the run order[i:j]
            shared = min(shared, common[i + 1])
            if shared < MIN_SHARED_PREFIX:
                break
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], start[j] = best[i] + (j - 1 - i) * shared, i
    runs, j = [], len(order)
    while j:
        runs.append(range(start[j], j))
        j = start[j]
    packs: list[tuple[list[int], int]] = []
    alone: list[int] = []
    for run in reversed(runs):
        shared = min((common[k] for k in run[1:]), default=len(ids[order[run[0]]]))
        limit = max(TOKENS_PER_MICRO_BATCH, *(len(ids[order[k]]) for k in run))
        piece: list[int] = []  # positions in order
        size = shared
        for k in [*run, None]:
            extra = 0 if k is None else len(ids[order[k]]) - shared
            if piece and (k is None or size + extra > limit):
                members = [order[m] for m in piece]
                prefix = min((common[m] for m in piece[1:]), default=0)
                lengths = [len(ids[i]) for i in members]
                packed = prefix + sum(n - prefix for n in lengths)
                if len(members) > 1 and packed <= PACKED_FRACTION * sum(lengths):
                    packs.append((members, prefix))
                else:
                    alone.extend(members)
                piece, size = [], shared
            if k is not None:
                piece.append(k)
                size += extra
    return packs, alone


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(k for k in range(n) if a[k] != b[k])


def target_logprobs(
    model: Transformer, data: Sequence[Prepared], packs: Sequence[Pack] = ()
) -> Tensor:
    """Logprobs of each datum's targets, concatenated: ``[sum of lengths]`` float32.

    Without ``packs`` the data are right-padded side by side; with them (they cover
    ``data`` in order) each pack's prefix runs once (:func:`packed_hidden_states`). The LM
    head runs on the real (unpadded) rows only, a pack's prefix rows once for all its data;
    when their ``[rows, vocab]`` logits would be large, in chunks whose logits are
    recomputed in the backward pass instead of kept (memory ``LOGIT_CHUNK_ROWS x vocab``,
    not ``rows x vocab``, for long data)."""
    device = model.embed_tokens.weight.device
    rows: Tensor | None = None  # each target's row of ``hidden`` (None: one row each)
    if packs:
        hidden, rows = packed_hidden_states(model, data, packs)
    else:
        lengths = [len(d.tokens) for d in data]
        ids = torch.zeros(len(data), max(lengths), dtype=torch.int64)
        real = torch.zeros(len(data), max(lengths), dtype=torch.bool)
        for row, d in enumerate(data):
            ids[row, : len(d.tokens)] = d.tokens
            real[row, : len(d.tokens)] = True
        ids, real = ids.to(device), real.to(device)
        # [N, hidden]; right padding is invisible causally
        hidden = model.hidden_states(ids)[real]
    targets = torch.cat([d.targets for d in data]).to(device)

    def score(h: Tensor, t: Tensor, r: Tensor | None) -> Tensor:
        logp = model.logits(h).float().log_softmax(-1)
        return logp.gather(1, t[:, None])[:, 0] if r is None else logp[r, t]

    if torch.is_grad_enabled() and hidden.shape[0] * model.config.vocab_size <= LOGIT_ELEMENTS:
        return score(hidden, targets, rows)
    # Chunks of rows: nothing is kept without gradients, else each chunk is recomputed.
    parts: list[tuple[Tensor, Tensor, Tensor | None]] = []
    picked: list[Tensor] = []  # each chunk's targets (their places in ``targets``)
    for s in range(0, hidden.shape[0], LOGIT_CHUNK_ROWS):
        h = hidden[s : s + LOGIT_CHUNK_ROWS]
        if rows is None:
            parts.append((h, targets[s : s + LOGIT_CHUNK_ROWS], None))
        else:
            sel = ((rows >= s) & (rows < s + LOGIT_CHUNK_ROWS)).nonzero()[:, 0]
            parts.append((h, targets[sel], rows[sel] - s))
            picked.append(sel)
    if torch.is_grad_enabled():
        scores = [checkpoint(score, *part, use_reentrant=False) for part in parts]
    else:
        scores = [score(*part) for part in parts]
    out = torch.cat(scores)
    return out if rows is None else out[torch.cat(picked).argsort()]


def packed_hidden_states(
    model: Transformer, data: Sequence[Prepared], packs: Sequence[Pack]
) -> tuple[Tensor, Tensor]:
    """The hidden states of the packs' rows ``[R, hidden]`` (flat: each pack's shared
    prefix, then each datum's tokens after it; see ``Transformer.packed_hidden_states``)
    and the row of each datum's position, concatenated in data order ``[sum of lengths]``:
    the prefix's row for a position inside the prefix, else the datum's own."""
    ids, rows, layout = [], [], []
    first = at = 0  # at: the pack's first row
    for pack in packs:
        group, p = data[first : first + pack.size], pack.prefix
        first += pack.size
        ids.append(group[0].tokens[:p])
        own = at + p
        for d in group:
            ids.append(d.tokens[p:])
            n = len(d.tokens) - p
            rows.append(torch.cat([torch.arange(at, at + p), torch.arange(own, own + n)]))
            own += n
        layout.append((p, [len(d.tokens) - p for d in group]))
        at = own
    device = model.embed_tokens.weight.device
    hidden = model.packed_hidden_states(torch.cat(ids).to(device), layout)
    return hidden, torch.cat(rows).to(device)


def tensor_value(values: Tensor) -> TensorValue:
    return TensorValue.floats(values.float().tolist())
