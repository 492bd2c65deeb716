"""Shared-prefix packing in the LoRA training backend: data that begin with the same tokens
run as one packed sequence, with the same logprobs, loss and gradients as side by side,
and no datum sees another's own tokens (fp32, CPU, tiny random models)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import adapters.torch.lora.forward as lora
from adapters.torch.lora.forward import Pack, micro_batches, prepare, shared_prefix_packs
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.models.config import ModelConfig
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.values import AdamParams, Datum, LoraSpec, TensorValue
from tests.support.tiny_models import VOCAB, save_tiny_model

ARCHS = ["llama", "qwen3", "gemma3"]  # gemma3: sliding-window layers (window 6)
UNPACKED = 1 << 30  # a MIN_SHARED_PREFIX no datum reaches: the side-by-side path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for arch in ARCHS:
        paths[arch] = tmp_path_factory.mktemp(arch)
        save_tiny_model(arch, paths[arch])
    return paths


@pytest.fixture(scope="module")
def backend(folders) -> LoraTrainingBackend:
    entries = [BaseModelEntry(arch, f, dtype=torch.float32) for arch, f in folders.items()]
    return LoraTrainingBackend(entries)


_ids = iter(range(1_000_000))


def _create(backend, arch: str) -> str:
    model_id = f"p{next(_ids)}"
    backend.create(model_id, arch, LoraSpec(rank=4, seed=11))
    with torch.no_grad():  # B away from zero: the adapter changes the forward
        for _, b in backend._adapter(model_id).weights.values():
            generator = torch.Generator().manual_seed(b.numel())
            b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    return model_id


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def _rl_tokens(seed: int) -> list[list[int]]:
    """Groups of prompt + sample tokens: prompts of 20 and 37 tokens (4 and 3 samples, one
    of them exactly the prompt), two data sharing nothing, and a pair sharing 18 tokens."""
    rng = np.random.default_rng(seed)
    seqs = []
    for prompt_len, samples in ((20, [3, 0, 7, 5]), (37, [9, 2, 6])):
        prompt = _tokens(rng, prompt_len)
        seqs += [prompt + _tokens(rng, n) for n in samples]
    seqs += [_tokens(rng, 12), _tokens(rng, 30)]
    head = _tokens(rng, 18)
    seqs += [head + _tokens(rng, 4), head + _tokens(rng, 6)]
    order = rng.permutation(len(seqs))  # groups scattered through the call
    return [seqs[i] for i in order]


def _data(loss_fn: str, seqs: list[list[int]], seed: int = 3) -> list[Datum]:
    """Data on ``seqs`` with random targets (not the next tokens: each datum gathers its
    own targets on the shared rows) and ``loss_fn``'s inputs."""
    rng = np.random.default_rng(seed)
    data = []
    for tokens in seqs:
        n = len(tokens)
        inputs = {"target_tokens": TensorValue.ints(_tokens(rng, n))}
        if loss_fn == "cross_entropy":
            inputs["weights"] = TensorValue.floats(rng.uniform(0, 2, n).tolist())
        else:
            # Sampler logprobs near the model's (ratios ~0.3 to 3: the trust band matters).
            inputs["logprobs"] = TensorValue.floats((-7 + rng.normal(0, 0.8, n)).tolist())
            inputs["advantages"] = TensorValue.floats(rng.normal(size=n).tolist())
            if loss_fn == "stable_reinforce":
                inputs["sampled_mask"] = TensorValue.floats((rng.random(n) < 0.6).tolist())
        data.append(Datum(tokens, inputs))
    return data


def _step(backend, model_id, data, loss_fn, *, backward=True):
    """(per-datum logprobs, loss, the LoRA weights' gradients), gradients cleared after."""
    batch = ForwardBackwardInput(data, loss_fn)
    result = backend.forward_backward(model_id, batch, backward=backward)
    params = backend._adapter(model_id).params
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    logprobs = [torch.tensor(o["logprobs"].data) for o in result.outputs]
    return logprobs, result.metrics["loss:sum"], grads


def _compare(packed, unpacked) -> None:
    (lp_a, loss_a, grads_a), (lp_b, loss_b, grads_b) = packed, unpacked
    for a, b in zip(lp_a, lp_b, strict=True):
        assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-5)
    assert all(g is not None for g in grads_a) == all(g is not None for g in grads_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        if a is not None:  # float32 sums in another order: close as a whole
            assert float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6


def _count_packed(monkeypatch) -> list[int]:
    """Packed rows run per micro-batch, recorded as the backend runs them."""
    counts: list[int] = []
    real = lora.packed_hidden_states

    def spy(model, data, packs):
        counts.append(len(packs))
        return real(model, data, packs)

    monkeypatch.setattr(lora, "packed_hidden_states", spy)
    return counts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "stable_reinforce"])
def test_packed_groups_give_the_side_by_side_logprobs_loss_and_gradients(
    backend, monkeypatch, arch, loss_fn
) -> None:
    model_id = _create(backend, arch)
    data = _data(loss_fn, _rl_tokens(seed=1))
    counts = _count_packed(monkeypatch)
    packed = _step(backend, model_id, data, loss_fn)
    assert counts == [3]  # three packs in one micro-batch; the two loners side by side
    monkeypatch.setattr(lora, "MIN_SHARED_PREFIX", UNPACKED)
    unpacked = _step(backend, model_id, data, loss_fn)
    assert counts == [3]
    assert any(g is not None and g.abs().sum() > 0 for g in packed[2])
    _compare(packed, unpacked)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_split_packs_and_chunked_logits_give_the_same_step(backend, monkeypatch, arch) -> None:
    """A micro-batch budget that cuts groups into several packs and packs into several
    micro-batches, and the LM head in recomputed chunks (with and without gradients)."""
    model_id = _create(backend, arch)
    data = _data("stable_reinforce", _rl_tokens(seed=2))
    monkeypatch.setattr(lora, "MIN_SHARED_PREFIX", UNPACKED)
    reference = _step(backend, model_id, data, "stable_reinforce")
    reference_forward = _step(backend, model_id, data, "stable_reinforce", backward=False)
    monkeypatch.setattr(lora, "MIN_SHARED_PREFIX", 16)
    monkeypatch.setattr(lora, "TOKENS_PER_MICRO_BATCH", 50)
    monkeypatch.setattr(lora, "LOGIT_ELEMENTS", 1)
    monkeypatch.setattr(lora, "LOGIT_CHUNK_ROWS", 7)
    counts = _count_packed(monkeypatch)
    split = _step(backend, model_id, data, "stable_reinforce")
    assert len(counts) > 2  # several packed micro-batches
    _compare(split, reference)
    forward = _step(backend, model_id, data, "stable_reinforce", backward=False)
    _compare(forward, reference_forward)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_datum_never_sees_another_datums_own_tokens(backend, monkeypatch, arch) -> None:
    """Changing one datum's tokens after the prompt changes its own logprobs after the
    prompt and nothing of the other data packed with it."""
    model_id = _create(backend, arch)
    seqs = _rl_tokens(seed=4)
    prompt_len = 37
    victim = next(i for i, s in enumerate(seqs) if len(s) == prompt_len + 9)
    changed = [list(s) for s in seqs]
    changed[victim][prompt_len + 2 :] = [(t + 1) % VOCAB for t in changed[victim][prompt_len + 2 :]]
    counts = _count_packed(monkeypatch)
    before, _, _ = _step(backend, model_id, _data("cross_entropy", seqs), "cross_entropy")
    after, _, _ = _step(backend, model_id, _data("cross_entropy", changed), "cross_entropy")
    assert counts == [3, 3]
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if i == victim:
            assert_close(a[: prompt_len + 2], b[: prompt_len + 2], atol=1e-6, rtol=0)
            assert (a[prompt_len + 2 :] - b[prompt_len + 2 :]).abs().min() > 1e-4
        else:
            assert_close(a, b, atol=1e-6, rtol=0)


def test_a_training_step_on_packed_data_equals_the_unpacked_step(backend, monkeypatch) -> None:
    """Through AdamW: the weights after a packed step are the side-by-side step's."""
    packed_id, unpacked_id = _create(backend, "qwen3"), _create(backend, "qwen3")
    start = [p.detach().clone() for p in backend._adapter(packed_id).params]
    data = _data("importance_sampling", _rl_tokens(seed=5))
    batch = ForwardBackwardInput(data, "importance_sampling")
    backend.forward_backward(packed_id, batch, backward=True)
    backend.optim_step(packed_id, AdamParams(learning_rate=0.01, eps=1.0))
    monkeypatch.setattr(lora, "MIN_SHARED_PREFIX", UNPACKED)
    backend.forward_backward(unpacked_id, batch, backward=True)
    backend.optim_step(unpacked_id, AdamParams(learning_rate=0.01, eps=1.0))
    packed = backend._adapter(packed_id).params
    unpacked = backend._adapter(unpacked_id).params
    for a, b, w in zip(packed, unpacked, start, strict=True):
        a, b = a.detach(), b.detach()
        assert float((b - w).norm()) > 0  # the step moved it
        assert float((a - b).norm()) <= 1e-4 * float((b - w).norm())


# --- which data are packed ----------------------------------------------------------------


def _prepared(folder: Path, seqs: list[list[int]]) -> list:
    config = ModelConfig.from_folder(folder)
    data = [Datum(s, {"target_tokens": TensorValue.ints(s)}) for s in seqs]
    return [prepare(config, i, d, "cross_entropy") for i, d in enumerate(data)]


def test_packs_are_the_runs_that_save_the_most_prefix_tokens(folders) -> None:
    rng = np.random.default_rng(0)
    system, prompt = _tokens(rng, 20), _tokens(rng, 40)
    seqs = [
        system + _tokens(rng, 50),  # 0: shares 20 tokens with 1-4 (too few for its length)
        system + prompt + [1, 2],  # 1-4: share 60
        system + prompt,  # exactly the prefix
        system + prompt + [3] * 5,
        system + prompt + [1, 2, 7],
        _tokens(rng, 30),  # 5: alone
        _tokens(rng, 10) + [4] * 10,  # 6, 7: share only 10 tokens
    ]
    seqs.append(seqs[6][:10] + [5] * 10)
    seqs += [[9] * 40, [9] * 40]  # 8, 9: the same datum twice
    packs, alone = shared_prefix_packs(_prepared(folders["llama"], seqs))
    assert sorted((sorted(m), p) for m, p in packs) == [([1, 2, 3, 4], 60), ([8, 9], 40)]
    assert sorted(alone) == [0, 5, 6, 7]


def test_micro_batches_keep_packs_whole_within_the_token_budget(folders, monkeypatch) -> None:
    """Two groups of 3 (a 30-token prompt and 5 more tokens each: 45 packed), a loner."""
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(2):
        prompt = _tokens(rng, 30)
        seqs += [prompt + _tokens(rng, 5) for _ in range(3)]
    seqs.append(_tokens(rng, 25))
    data = _prepared(folders["llama"], seqs)

    def plan(budget: int) -> list[tuple[list[int], list[Pack]]]:
        monkeypatch.setattr(lora, "TOKENS_PER_MICRO_BATCH", budget)
        batches = list(micro_batches(data))
        assert sorted(i for group, _ in batches for i in group) == list(range(7))
        for group, packs in batches:  # a pack's data are consecutive and share its prefix
            first = 0
            for pack in packs:
                members = [seqs[i] for i in group[first : first + pack.size]]
                assert all(m[: pack.prefix] == members[0][: pack.prefix] for m in members)
                first += pack.size
            assert first == (len(group) if packs else 0)
        return batches

    assert [packs for _, packs in plan(2048)] == [[Pack(3, 30), Pack(3, 30)], []]
    assert [packs for _, packs in plan(90)] == [[Pack(3, 30), Pack(3, 30)], []]
    assert [packs for _, packs in plan(45)] == [[Pack(3, 30)], [Pack(3, 30)], []]
    # Packs of two (40 tokens) one per micro-batch; the third of each group goes alone.
    batches = plan(40)
    assert [packs for _, packs in batches] == [[Pack(2, 30)]] * 2 + [[]] * 3
    assert [len(group) for group, _ in batches] == [2, 2, 1, 1, 1]
    # A budget below every datum: each goes alone, unpacked.
    assert [packs for _, packs in plan(20)] == [[]] * 7


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_identical_data_share_every_row(backend, monkeypatch, arch) -> None:
    """The same tokens three times (different targets): one pack with no rows of its own."""
    model_id = _create(backend, arch)
    tokens = _tokens(np.random.default_rng(6), 24)
    data = _data("stable_reinforce", [tokens] * 3)
    counts = _count_packed(monkeypatch)
    packed = _step(backend, model_id, data, "stable_reinforce")
    assert counts == [1]
    monkeypatch.setattr(lora, "MIN_SHARED_PREFIX", UNPACKED)
    _compare(packed, _step(backend, model_id, data, "stable_reinforce"))
