"""The LoRA training backend on tiny random models: parity with transformers and PEFT,
each loss's value and gradient, AdamW, checkpoints and input errors (fp32, CPU)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from adapters.torch.lora import peft
from adapters.torch.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_lora_spec
from adapters.torch.lora.training import OPTIMIZER_STATE, BaseModelEntry, LoraTrainingBackend
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.values import AdamParams, Datum, LoraSpec, TensorValue
from tests.support.tiny_models import VOCAB, save_tiny_model

ARCHS = ["llama", "qwen3", "gemma3"]
LENGTHS = (16, 9)  # longer than Gemma's sliding window (6); two lengths: a padded batch


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for arch in ARCHS:
        paths[arch] = tmp_path_factory.mktemp(arch)
        save_tiny_model(arch, paths[arch])
    return paths


@pytest.fixture(scope="module")
def backend(folders) -> LoraTrainingBackend:
    entries = [
        BaseModelEntry(arch, folder, aliases=(f"tiny-{arch}",), dtype=torch.float32)
        for arch, folder in folders.items()
    ]
    return LoraTrainingBackend(entries)


_ids = iter(range(1_000_000))


def _create(backend, arch: str = "llama", **spec) -> str:
    model_id = f"m{next(_ids)}"
    backend.create(model_id, arch, LoraSpec(**{"rank": 4, "seed": 7, **spec}))
    return model_id


def _sequence(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length + 1).tolist()


def _datum(length: int, seed: int, **floats: list[float]) -> Datum:
    """A datum on a random sequence: input ``seq[:-1]``, targets ``seq[1:]``; ``floats``
    default to ``weights`` of ones."""
    seq = _sequence(length, seed)
    inputs = {"target_tokens": TensorValue.ints(seq[1:])}
    for key, values in (floats or {"weights": [1.0] * length}).items():
        inputs[key] = TensorValue.floats(values)
    return Datum(seq[:-1], inputs)


def _data() -> list[Datum]:
    return [_datum(n, seed) for seed, n in enumerate(LENGTHS)]


def _logprobs(backend, model_id: str, data: list[Datum]) -> list[np.ndarray]:
    result = backend.forward_backward(
        model_id, ForwardBackwardInput(data, "cross_entropy"), backward=False
    )
    return [np.asarray(out["logprobs"].data) for out in result.outputs]


def _train(backend, model_id: str, steps: int, lr: float = 0.02) -> None:
    for _ in range(steps):
        backend.forward_backward(
            model_id, ForwardBackwardInput(_data(), "cross_entropy"), backward=True
        )
        backend.optim_step(model_id, AdamParams(learning_rate=lr))


def _reference_logprobs(model: torch.nn.Module, data: list[Datum]) -> list[np.ndarray]:
    out = []
    for d in data:
        with torch.no_grad():
            logits = model(torch.tensor([list(d.tokens)])).logits[0]
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data.tolist())
        out.append(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0].numpy())
    return out


def _peft_model(folder: Path, checkpoint: Path) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, checkpoint, is_trainable=True).eval()


# --- forward parity -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_adapter_logprobs_equal_the_base_models_in_transformers(
    backend, folders, arch
) -> None:
    model_id = _create(backend, arch)
    reference = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    ours = _logprobs(backend, model_id, _data())
    for got, want in zip(ours, _reference_logprobs(reference, _data()), strict=True):
        assert got.shape == want.shape
        assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "spec"),
    [
        ("llama", {}),
        ("qwen3", {}),  # lm_head tied to the embeddings
        ("gemma3", {}),
        ("llama", {"train_attn": False}),
        ("qwen3", {"train_mlp": False, "train_unembed": False}),
    ],
)
def test_trained_adapter_loads_in_peft_with_the_same_logprobs(
    backend, folders, tmp_path, arch, spec
) -> None:
    model_id = _create(backend, arch, **spec)
    before = _logprobs(backend, model_id, _data())
    _train(backend, model_id, steps=3)
    ours = _logprobs(backend, model_id, _data())
    assert max(np.abs(a - b).max() for a, b in zip(ours, before, strict=True)) > 1e-2
    backend.save(model_id, tmp_path, optimizer=False)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 32
    peft = _peft_model(folders[arch], tmp_path)
    assert set(load_file(tmp_path / ADAPTER_WEIGHTS)) == set(
        get_peft_model_state_dict(peft, save_embedding_layers=False)
    )
    for got, want in zip(ours, _reference_logprobs(peft, _data()), strict=True):
        assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-4, rtol=1e-4)


# --- gradients and AdamW ------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_a_step_equals_peft_autograd_then_torch_adamw(backend, folders, tmp_path, clip) -> None:
    """Our gradient, clipping and AdamW against PEFT's autograd and torch.optim.AdamW."""
    trained = _create(backend, "gemma3")
    _train(backend, trained, steps=2)  # B nonzero, so A gets gradients too
    backend.save(trained, tmp_path / "start", optimizer=False)
    model_id = _create(backend, "gemma3")
    backend.load(model_id, tmp_path / "start", optimizer=False)
    rng = np.random.default_rng(3)
    data = [_datum(n, s, weights=rng.normal(size=n).tolist()) for s, n in enumerate(LENGTHS)]
    params = AdamParams(
        learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1, grad_clip_norm=clip
    )

    result = backend.forward_backward(
        model_id, ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    metrics = backend.optim_step(model_id, params)
    backend.save(model_id, tmp_path / "ours", optimizer=False)

    peft = _peft_model(folders["gemma3"], tmp_path / "start")
    lora = [p for p in peft.parameters() if p.requires_grad]
    loss = torch.zeros(())
    for d in data:
        logits = peft(torch.tensor([list(d.tokens)])).logits[0]
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data.tolist())
        logp = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
        loss = loss - (torch.tensor(d.loss_fn_inputs["weights"].data.tolist()) * logp).sum()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in lora if p.grad is not None])
    if clip:
        assert norm > clip  # the clip applies
        torch.nn.utils.clip_grad_norm_(lora, clip)
    torch.optim.AdamW(lora, lr=0.01, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1).step()

    assert result.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-4)
    assert metrics["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-4)
    assert metrics["learning_rate:mean"] == 0.01
    ours, want = (
        load_file(tmp_path / "ours" / ADAPTER_WEIGHTS),
        get_peft_model_state_dict(peft, save_embedding_layers=False),
    )
    start = load_file(tmp_path / "start" / ADAPTER_WEIGHTS)
    for key, tensor in want.items():  # the updates agree to 0.1% of the learning rate
        assert_close(ours[key] - start[key], tensor.detach() - start[key], atol=1e-5, rtol=1e-3)


def test_gradients_accumulate_across_calls_until_the_step(backend, tmp_path) -> None:
    twice, once = _create(backend), _create(backend)
    data = _data()
    for _ in range(2):
        backend.forward_backward(twice, ForwardBackwardInput(data, "cross_entropy"), backward=True)
    backend.forward_backward(
        once, ForwardBackwardInput(data + data, "cross_entropy"), backward=True
    )
    params = AdamParams(learning_rate=0.01, eps=1.0)  # a large eps: the step scales with grads
    assert backend.optim_step(twice, params) == pytest.approx(backend.optim_step(once, params))
    # The step cleared them, and a forward-only call adds none.
    backend.forward_backward(twice, ForwardBackwardInput(data, "cross_entropy"), backward=False)
    assert backend.optim_step(twice, AdamParams())["grad_norm:mean"] == 0.0


# --- losses -------------------------------------------------------------------------------


def _rl_data(logprobs: list[np.ndarray], seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for i, (n, lp) in enumerate(zip(LENGTHS, logprobs, strict=True)):
        sampler = lp + rng.normal(scale=0.5, size=n)  # ratios roughly 0.3 to 3: clips trigger
        # GSPO's ratio over the "sampled" part: the positions after the first third
        mask = [0.0] * (n // 3) + [1.0] * (n - n // 3)
        data.append(
            _datum(
                n,
                i,
                logprobs=sampler.tolist(),
                advantages=rng.normal(size=n).tolist(),
                sequence_ratio_mask=mask,
            )
        )
    return data


def _gspo_reference(lp: np.ndarray, q: np.ndarray, a: np.ndarray, mask: np.ndarray, config):
    """Tinker's documented GSPO-token, in torch as its page writes it, on one datum: (value,
    the gradient with respect to each target logprob)."""
    target = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    ref, adv = torch.tensor(q, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)
    in_ratio = torch.tensor(mask) != 0
    log_ratio = (target.detach() - ref)[in_ratio].mean()
    ratio = torch.exp(log_ratio + target - target.detach())
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    loss = -torch.min(ratio * adv, clipped * adv).sum()
    loss.backward()
    assert target.grad is not None
    return float(loss), target.grad.numpy()


def _expected(loss_fn: str, lp: np.ndarray, q: np.ndarray, a: np.ndarray, config) -> tuple:
    """(loss value, per-token weights w such that the loss's gradient is -sum(w dlogp))."""
    r = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(r * a).sum(), r * a
    if loss_fn == "ppo":
        clipped = np.clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
        unclipped_wins = r * a <= clipped * a
        return -np.minimum(r * a, clipped * a).sum(), np.where(unclipped_wins, r * a, 0.0)
    if loss_fn == "cispo":
        clipped = np.clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
        return -(clipped * lp * a).sum(), clipped * a
    assert loss_fn == "dro"
    beta = config["beta"]
    return -(lp * a - 0.5 * beta * (lp - q) ** 2).sum(), a - beta * (lp - q)


@pytest.mark.parametrize(
    ("loss_fn", "config", "effective"),
    [
        ("importance_sampling", {}, {}),
        ("ppo", {}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, None),
        ("cispo", {}, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, None),
        ("dro", {}, {"beta": 0.05}),
        ("dro", {"beta": 0.5}, None),
        ("gspo", {}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}, None),
    ],
)
def test_rl_loss_value_and_gradient_follow_the_formula(
    backend, tmp_path, loss_fn, config, effective
) -> None:
    """The value against numpy; the gradient equals cross_entropy's with the per-token
    weights the formula's derivative gives (so a missing stop-gradient or a wrong clip
    branch shows)."""
    model_id, twin = _create(backend), _create(backend)
    _train(backend, model_id, steps=1)
    backend.save(model_id, tmp_path / "start", optimizer=False)
    backend.load(twin, tmp_path / "start", optimizer=False)
    backend.load(model_id, tmp_path / "start", optimizer=False)  # both with fresh AdamW
    lps = _logprobs(backend, model_id, _data())
    data = _rl_data(lps, seed=5)
    expected, weights = 0.0, []
    for d, lp in zip(data, lps, strict=True):
        inputs = {k: np.asarray(v.data) for k, v in d.loss_fn_inputs.items()}
        if loss_fn == "gspo":
            mask = inputs["sequence_ratio_mask"]
            value, grad = _gspo_reference(
                lp, inputs["logprobs"], inputs["advantages"], mask, effective or config
            )
            w = -grad
        else:
            value, w = _expected(
                loss_fn, lp, inputs["logprobs"], inputs["advantages"], effective or config
            )
        expected += value
        weights.append(w)

    result = backend.forward_backward(
        model_id, ForwardBackwardInput(data, loss_fn, config), backward=True
    )
    ce_data = [
        _datum(n, i, weights=w.tolist())
        for i, (n, w) in enumerate(zip(LENGTHS, weights, strict=True))
    ]
    backend.forward_backward(twin, ForwardBackwardInput(ce_data, "cross_entropy"), backward=True)

    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    for out, lp in zip(result.outputs, lps, strict=True):
        assert_close(torch.tensor(out["logprobs"].data), torch.from_numpy(lp))
    params = AdamParams(learning_rate=0.01, eps=1.0)
    grad_norm = backend.optim_step(model_id, params)["grad_norm:mean"]
    assert grad_norm > 0
    assert grad_norm == pytest.approx(backend.optim_step(twin, params)["grad_norm:mean"], rel=1e-4)


def _stable_reinforce_reference(lp, q, a, mask, kl_coeff: float) -> tuple[float, np.ndarray]:
    """StableReinforce as docs/tinker.md states it, in float64 torch on one datum: (value, the
    gradient with respect to each target logprob)."""
    target = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    ref, adv, m = (torch.tensor(x, dtype=torch.float64) for x in (q, a, mask))
    ratio = torch.exp(target - ref)
    inside = ((ratio >= 0.5) & (ratio <= 2.0)).double()
    policy = -(m * inside * ratio * adv).sum()
    kl = (m * (ratio - 1 - torch.log(ratio))).sum()
    loss = policy + kl_coeff * kl
    loss.backward()
    assert target.grad is not None
    return loss.item(), target.grad.numpy()


@pytest.mark.parametrize("kl_coeff", [None, 0.3])
def test_stable_reinforce_value_and_gradient_follow_the_formula(
    backend, tmp_path, kl_coeff
) -> None:
    """Ratios spread over about 0.1 to 10, so the trust band drops some tokens' policy
    gradient; the gradient is checked as cross_entropy's with the reference's weights."""
    model_id, twin = _create(backend), _create(backend)
    _train(backend, model_id, steps=1)
    backend.save(model_id, tmp_path / "start", optimizer=False)
    backend.load(twin, tmp_path / "start", optimizer=False)
    lps = _logprobs(backend, model_id, _data())
    data, expected, weights, outside = [], 0.0, [], 0
    for d, lp in zip(_rl_data(lps, seed=7), lps, strict=True):
        inputs = {k: np.asarray(v.data, dtype=np.float64) for k, v in d.loss_fn_inputs.items()}
        inputs["logprobs"] = lp + np.random.default_rng(len(lp)).normal(size=len(lp))
        mask = inputs["sequence_ratio_mask"]  # the "sampled" part
        adv = inputs["advantages"] * mask
        value, grad = _stable_reinforce_reference(lp, inputs["logprobs"], adv, mask, kl_coeff or 0)
        expected += value
        weights.append(-grad)
        ratio = np.exp(lp - inputs["logprobs"])
        outside += int((((ratio < 0.5) | (ratio > 2.0)) & (mask > 0)).sum())
        fields = dict(d.loss_fn_inputs)
        fields["logprobs"] = TensorValue.floats(inputs["logprobs"].tolist())
        fields["advantages"] = TensorValue.floats(adv.tolist())
        fields["sampled_mask"] = TensorValue.floats(mask.tolist())
        data.append(Datum(d.tokens, fields))
    assert outside > 0  # the band matters in this data
    config = {} if kl_coeff is None else {"kl_coeff": kl_coeff}
    result = backend.forward_backward(
        model_id, ForwardBackwardInput(data, "stable_reinforce", config), backward=True
    )
    ce_data = [
        _datum(n, i, weights=w.tolist())
        for i, (n, w) in enumerate(zip(LENGTHS, weights, strict=True))
    ]
    backend.forward_backward(twin, ForwardBackwardInput(ce_data, "cross_entropy"), backward=True)
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    params = AdamParams(learning_rate=0.01, eps=1.0)
    grad_norm = backend.optim_step(model_id, params)["grad_norm:mean"]
    assert grad_norm > 0
    assert grad_norm == pytest.approx(backend.optim_step(twin, params)["grad_norm:mean"], rel=1e-4)


def test_cross_entropy_value_is_the_weighted_sum_of_target_logprobs(backend) -> None:
    model_id = _create(backend)
    lps = _logprobs(backend, model_id, _data())
    weights = [np.linspace(0, 2, n) for n in LENGTHS]
    data = [
        _datum(n, i, weights=w.tolist())
        for i, (n, w) in enumerate(zip(LENGTHS, weights, strict=True))
    ]
    result = backend.forward_backward(
        model_id, ForwardBackwardInput(data, "cross_entropy"), backward=False
    )
    expected = -sum((w * lp).sum() for w, lp in zip(weights, lps, strict=True))
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_training_on_one_sequence_lowers_its_loss(backend) -> None:
    model_id = _create(backend, "qwen3")
    datum = [_datum(12, seed=11)]
    losses = []
    for _ in range(20):
        result = backend.forward_backward(
            model_id, ForwardBackwardInput(datum, "cross_entropy"), backward=True
        )
        losses.append(result.metrics["loss:sum"])
        backend.optim_step(model_id, AdamParams(learning_rate=0.01))
    assert losses[-1] < 0.3 * losses[0]


# --- checkpoints --------------------------------------------------------------------------


def test_save_then_load_restores_weights_and_optimizer(backend, tmp_path) -> None:
    model_id = _create(backend, "gemma3", train_mlp=False)
    _train(backend, model_id, steps=3)
    backend.save(model_id, tmp_path, optimizer=True)
    assert {p.name for p in tmp_path.iterdir()} == {
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        OPTIMIZER_STATE,
    }
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / OPTIMIZER_STATE).values())

    spec = read_lora_spec(tmp_path)
    assert spec == LoraSpec(rank=4, train_mlp=False, train_attn=True, train_unembed=True)
    restored = f"restored-{model_id}"
    backend.create(restored, "tiny-gemma3", spec)  # by alias; another seed: load overwrites
    backend.load(restored, tmp_path, optimizer=True)
    for original, copy in zip(
        _logprobs(backend, model_id, _data()), _logprobs(backend, restored, _data()), strict=True
    ):
        np.testing.assert_array_equal(original, copy)

    _train(backend, model_id, steps=1)
    _train(backend, restored, steps=1)
    backend.save(model_id, tmp_path / "a", optimizer=True)
    backend.save(restored, tmp_path / "b", optimizer=True)
    for name in (ADAPTER_WEIGHTS, OPTIMIZER_STATE):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)


def test_load_rejects_a_checkpoint_of_another_shape(backend, tmp_path) -> None:
    model_id = _create(backend, rank=8)
    backend.save(_create(backend, rank=4), tmp_path, optimizer=False)
    with pytest.raises(InvalidTrainingRequest, match="rank 4"):
        backend.load(model_id, tmp_path, optimizer=False)
    with pytest.raises(InvalidTrainingRequest, match=r"optimizer\.safetensors"):
        backend.load(_create(backend, rank=4), tmp_path, optimizer=True)
    with pytest.raises(InvalidTrainingRequest, match=r"adapter_config\.json"):
        read_lora_spec(tmp_path / "nowhere")


def test_create_is_deterministic_for_a_seed(backend, tmp_path) -> None:
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        backend.save(_create(backend, seed=seed), tmp_path / name, optimizer=False)
    a, b, c = (load_file(tmp_path / n / ADAPTER_WEIGHTS) for n in "abc")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
    assert a[key].shape == (4, 64) and a[key].abs().max() <= 64**-0.5
    assert not a["base_model.model.lm_head.lora_B.weight"].any()


# --- errors and bookkeeping ---------------------------------------------------------------


def test_base_models_describe_each_served_model(backend, folders) -> None:
    infos = {info.name: info for info in backend.base_models}
    assert set(infos) == set(ARCHS)
    assert infos["gemma3"].arch == "gemma3" and infos["gemma3"].max_context_length == 256
    assert infos["qwen3"].tokenizer_id == str(folders["qwen3"])
    assert infos["llama"].aliases == ("tiny-llama",)


@pytest.mark.parametrize(
    ("loss_fn", "config", "data", "message"),
    [
        ("mse", {}, _data(), "unknown loss 'mse'"),
        ("ppo", {"beta": 1.0}, _data(), "'beta' is not a parameter of ppo"),
        ("ppo", {}, _data(), "missing 'logprobs'"),
        ("cross_entropy", {}, [_datum(4, 0, weights=[1.0] * 3)], r"\['weights'\]: shape \[3\]"),
        ("cross_entropy", {}, [Datum([1, VOCAB], _datum(2, 0).loss_fn_inputs)], f"id {VOCAB}"),
        ("cross_entropy", {}, [], "empty"),
    ],
)
def test_bad_requests_are_rejected_naming_the_problem(
    backend, loss_fn, config, data, message
) -> None:
    model_id = _create(backend)
    with pytest.raises(InvalidTrainingRequest, match=message):
        backend.forward_backward(
            model_id, ForwardBackwardInput(data, loss_fn, config), backward=True
        )
    assert backend.optim_step(model_id, AdamParams())["grad_norm:mean"] == 0.0  # nothing kept


def test_out_of_range_target_and_overlong_input_are_rejected(backend) -> None:
    model_id = _create(backend)
    bad_target = Datum(
        [1, 2], {**_datum(2, 0).loss_fn_inputs, "target_tokens": TensorValue.ints([3, -1])}
    )
    with pytest.raises(InvalidTrainingRequest, match=r"target_tokens'\]: token id -1"):
        backend.forward_backward(
            model_id, ForwardBackwardInput([bad_target], "cross_entropy"), backward=False
        )
    with pytest.raises(InvalidTrainingRequest, match="exceed the model's context of 256"):
        backend.forward_backward(
            model_id, ForwardBackwardInput([_datum(257, 0)], "cross_entropy"), backward=False
        )


def test_unknown_models_and_released_adapters_are_not_found(backend) -> None:
    with pytest.raises(NotFoundError, match="unknown model 'gpt-5'"):
        backend.create("x", "gpt-5", LoraSpec(rank=2))
    model_id = _create(backend)
    backend.release(model_id)
    backend.release(model_id)  # unknown ids are ignored
    with pytest.raises(NotFoundError):
        backend.optim_step(model_id, AdamParams())


def test_chunked_logits_with_recomputation_give_the_same_step(backend, monkeypatch) -> None:
    """Past LOGIT_ELEMENTS logits, the LM head runs in checkpointed chunks: the same
    logprobs, loss and update as all at once (only the memory differs)."""
    import adapters.torch.lora.forward as lora

    data = _data()
    whole, chunked = _create(backend, seed=3), _create(backend, seed=3)
    plain = backend.forward_backward(
        whole, ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    backend.optim_step(whole, AdamParams(learning_rate=0.02))
    monkeypatch.setattr(lora, "LOGIT_ELEMENTS", 1)
    monkeypatch.setattr(lora, "LOGIT_CHUNK_ROWS", 3)
    split = backend.forward_backward(
        chunked, ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    backend.optim_step(chunked, AdamParams(learning_rate=0.02))
    assert split.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-6)
    for a, b in zip(split.outputs, plain.outputs, strict=True):
        assert_close(np.asarray(a["logprobs"].data), np.asarray(b["logprobs"].data))
    for a, b in zip(
        _logprobs(backend, chunked, data), _logprobs(backend, whole, data), strict=True
    ):
        assert_close(a, b, atol=1e-6, rtol=1e-6)


def _all_float32_update(self, x):
    """LoraLinear's update computed wholly in float32 (the reference for the bf16 path)."""
    y = self.base(x)
    if self.lora is None:
        return y
    a = torch.cat([a for a, _ in self.lora])
    b = torch.block_diag(*[b for _, b in self.lora])
    return y + (F.linear(F.linear(x.float(), a) * self.scale, b)).to(y.dtype)


def test_bf16_mixed_precision_update_is_as_accurate_as_float32_math(
    backend, folders, monkeypatch
) -> None:
    """With bf16 base weights, the LoRA update runs its wide products in bf16: three steps
    of training land as close to the float32 model as doing the update in float32 does."""
    import adapters.torch.lora.training as lora

    def train(trainer: LoraTrainingBackend, name: str, arch: str) -> tuple[float, np.ndarray]:
        trainer.create(name, arch, LoraSpec(rank=4, seed=11))
        for _ in range(3):
            out = trainer.forward_backward(
                name, ForwardBackwardInput(_data(), "cross_entropy"), backward=True
            )
            trainer.optim_step(name, AdamParams(learning_rate=0.02))
        return out.metrics["loss:sum"], np.concatenate(_logprobs(trainer, name, _data()))

    for arch in ("llama", "qwen3"):
        exact_loss, exact = train(backend, f"exact-{arch}", arch)
        half = LoraTrainingBackend([BaseModelEntry(arch, folders[arch], dtype=torch.bfloat16)])
        mixed_loss, mixed = train(half, "mixed", arch)
        with monkeypatch.context() as m:
            m.setattr(lora.LoraLinear, "forward", _all_float32_update)
            ref_loss, ref = train(half, "reference", arch)
        assert mixed_loss == pytest.approx(exact_loss, rel=0.02)
        assert abs(mixed_loss - exact_loss) <= 1.5 * abs(ref_loss - exact_loss) + 0.01 * exact_loss
        assert np.abs(mixed - exact).mean() <= 1.25 * np.abs(ref - exact).mean() + 0.01


# --- PEFT format ------------------------------------------------------------------------


def test_peft_tensor_keys_pair_up_by_module() -> None:
    a, b = torch.zeros(2, 3), torch.ones(5, 2)
    name = "model.layers.0.self_attn.q_proj"
    state = {peft.tensor_key(name, "A"): a, peft.tensor_key(name, "B"): b, "other": a}
    assert peft.tensor_key(name, "A") == f"base_model.model.{name}.lora_A.weight"
    pairs = peft.module_pairs(state)
    assert list(pairs) == [name] and pairs[name][0] is a and pairs[name][1] is b
    only_b = peft.module_pairs({peft.tensor_key("lm_head", "B"): b})
    assert only_b == {"lm_head": (None, b)}


def test_peft_sites_cover_every_target_module_once() -> None:
    sites = dict(peft.site_parts(2))
    assert len(sites) == 2 * 4 + 1 and sites["lm_head"] == ("lm_head",)
    assert sites["layers.1.attn.wqkv"] == tuple(
        f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")
    )
    short = [name.rsplit(".", 1)[-1] for parts in sites.values() for name in parts]
    assert sorted(set(short)) == sorted(name for g in peft.GROUPS.values() for name in g)
    assert len(short) == 2 * 7 + 1


def test_peft_config_round_trip_and_scale(tmp_path) -> None:
    spec = LoraSpec(rank=8, train_mlp=True, train_attn=False, train_unembed=True)
    peft.write_config(tmp_path, base_model="m", rank=8, modules=peft.targets(spec))
    assert read_lora_spec(tmp_path) == spec
    assert peft.scale(peft.read_config(tmp_path)) == peft.LORA_ALPHA / 8
    assert peft.scale({"r": 4}) == 1.0  # alpha defaults to r, as in PEFT
    for bad in ({}, {"r": 0}, {"r": "8"}, {"r": 8, "lora_alpha": "x"}):
        with pytest.raises(InvalidTrainingRequest, match="r must be"):
            peft.scale(bad)
