"""ToyBackend: a numpy bigram language model with a trainable low-rank adapter.

The base model is frozen random embeddings ``E`` (vocab x dim) and an unembedding ``W``
(dim x vocab), seeded: ``logits(next | x) = E[x] @ (W + A @ B)``. An "adapter" is ``A`` (dim x
rank, seeded) and ``B`` (rank x vocab, zero), so a fresh adapter is the base model — the
same shape of thing as LoRA. Gradients are computed by hand; AdamW keeps running moments,
Dimuon a momentum (the LoRA backend's algorithm, in numpy).
Implements both ports, TrainingBackend and SamplingBackend, instantly, so the whole SDK
flow is testable in milliseconds. Checkpoints are safetensors files.
"""

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from safetensors.numpy import load_file, save_file

from domain.tinker.batch import ForwardBackwardInput, ForwardBackwardResult
from domain.tinker.checks import check_data, loss_config
from domain.tinker.custom_loss import CustomLossGradient, reduce_metrics
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError, UnsupportedFeatureError
from domain.tinker.ports import Steps, TrainingBackend
from domain.tinker.values import (
    LOSS_INPUTS,
    STABLE_REINFORCE_TRUST,
    AdamParams,
    BaseModelInfo,
    Datum,
    DimuonParams,
    LoraSpec,
    OptimizerFamily,
    PromptAltTokens,
    SampledSequence,
    SampleRequest,
    TensorValue,
    TinkerSampleResult,
    TinkerSamplingParams,
    TopK,
    WeightsSource,
    optimizer_of,
)

ADAPTER = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"


@dataclass
class _ToyAdapter:
    base: str
    lora: LoraSpec
    a: np.ndarray
    b: np.ndarray
    grad_a: np.ndarray
    grad_b: np.ndarray
    m: dict[str, np.ndarray] = field(default_factory=dict)  # AdamW's or Dimuon's momentum
    v: dict[str, np.ndarray] = field(default_factory=dict)
    step: int = 0
    family: OptimizerFamily = "adamw"


class ToyBackend(TrainingBackend):
    def __init__(
        self,
        name: str = "toy/bigram",
        *,
        vocab_size: int = 512,
        dim: int = 32,
        max_context: int = 4096,
        eos_token_id: int = 0,
        seed: int = 0,
        aliases: Sequence[str] = (),
        tokenizer_id: str = "",
        decode: Callable[[Sequence[int]], str] | None = None,
        custom_loss: CustomLossGradient | None = None,
    ) -> None:
        """``custom_loss``: runs stored custom losses (loss_fn ``custom``; None: refused)."""
        rng = np.random.default_rng(seed)
        self._info = BaseModelInfo(name, max_context, "toy", tokenizer_id, tuple(aliases))
        self.vocab_size, self.dim, self.eos = vocab_size, dim, eos_token_id
        self._embed = rng.standard_normal((vocab_size, dim)).astype(np.float32)
        self._unembed = (rng.standard_normal((dim, vocab_size)) / np.sqrt(dim)).astype(np.float32)
        self._decode = decode
        self._custom_loss = custom_loss
        self._adapters: dict[str, _ToyAdapter] = {}
        self._lock = threading.Lock()

    @property
    def base_models(self) -> Sequence[BaseModelInfo]:
        return [self._info]

    # --- TrainingBackend --------------------------------------------------------------

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        self._check_base(base_model)
        rng = np.random.default_rng(lora.seed)
        a = (rng.standard_normal((self.dim, lora.rank)) / np.sqrt(self.dim)).astype(np.float32)
        b = np.zeros((lora.rank, self.vocab_size), np.float32)
        with self._lock:
            self._adapters[model_id] = _ToyAdapter(
                base_model, lora, a, b, np.zeros_like(a), np.zeros_like(b)
            )

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        """One datum per piece (the gradient is added to the adapter's at the end)."""
        data, loss_fn, loss_fn_config = batch.data, batch.loss_fn, batch.loss_fn_config
        check_data(data, loss_fn)  # inputs present, one value per input position
        custom, run_custom = batch.custom_loss, self._custom_loss
        if custom is not None and run_custom is None:
            raise UnsupportedFeatureError("custom losses: this backend has no custom-loss runner")
        metric_sums: dict[str, float] = {}  # a custom loss's metrics, summed over data
        outputs: list[dict[str, TensorValue]] = []
        total = 0.0
        grad_w: np.ndarray | None = None
        for i, datum in enumerate(data):
            if i:
                yield  # another model's turn may come here
            with self._lock:
                ad = self._get(model_id)
                w = self._unembed + ad.a @ ad.b
                x = self._tokens(datum.tokens, f"data[{i}].model_input")
                inputs = _inputs(datum, loss_fn, len(x))
                y = self._tokens(inputs["target_tokens"], f"data[{i}].targets")
                h = self._embed[x]  # [T, dim]
                logits = h @ w
                logp_all = logits - _logsumexp(logits)
                logp = logp_all[np.arange(len(y)), y]
                if custom is not None and run_custom is not None:
                    loss, grad, metrics = run_custom(custom, logp.tolist(), datum, i)
                    g = np.asarray(grad, np.float32)
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + value
                else:
                    loss, g = _loss(loss_fn, logp, inputs, loss_fn_config)
                total += loss
                outputs.append({"logprobs": TensorValue.floats(logp.astype(np.float32).tolist())})
                if backward:
                    probs = np.exp(logp_all)
                    dz = -probs * g[:, None]
                    dz[np.arange(len(y)), y] += g
                    grad_w = h.T @ dz if grad_w is None else grad_w + h.T @ dz
        if grad_w is not None:
            with self._lock:
                ad = self._get(model_id)
                ad.grad_a += grad_w @ ad.b.T
                ad.grad_b += ad.a.T @ grad_w
        metrics = {"loss:sum": float(total), **reduce_metrics(metric_sums, len(data))}
        return ForwardBackwardResult(outputs, metrics)

    def optim_step(self, model_id: str, params: AdamParams | DimuonParams) -> dict[str, float]:
        with self._lock:
            ad = self._get(model_id)
            family = optimizer_of(params)
            if family != ad.family:
                if ad.step:
                    raise InvalidTrainingRequest(
                        f"this model steps with {ad.family}; {family} parameters were given"
                    )
                ad.family, ad.m, ad.v = family, {}, {}
            norm = float(np.sqrt((ad.grad_a**2).sum() + (ad.grad_b**2).sum()))
            scale = 1.0
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                scale = params.grad_clip_norm / (norm + 1e-6)
            ad.step += 1
            for key, p, g in (("a", ad.a, ad.grad_a), ("b", ad.b, ad.grad_b)):
                g = g * scale
                if isinstance(params, DimuonParams):
                    mu = ad.m.setdefault(key, np.zeros_like(p))
                    mu[...] = params.beta1 * mu + (1 - params.beta1) * g
                    p -= params.learning_rate * _dimuon_direction(mu)
                    continue
                m = ad.m.setdefault(key, np.zeros_like(p))
                v = ad.v.setdefault(key, np.zeros_like(p))
                m[...] = params.beta1 * m + (1 - params.beta1) * g
                v[...] = params.beta2 * v + (1 - params.beta2) * g * g
                m_hat = m / (1 - params.beta1**ad.step)
                v_hat = v / (1 - params.beta2**ad.step)
                p *= 1 - params.learning_rate * params.weight_decay
                p -= params.learning_rate * m_hat / (np.sqrt(v_hat) + params.eps)
                g.fill(0)
            ad.grad_a.fill(0)
            ad.grad_b.fill(0)
            return {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate}

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        with self._lock:
            ad = self._get(model_id)
            save_file({"lora_A": ad.a, "lora_B": ad.b}, str(folder / ADAPTER))
            (folder / CONFIG).write_text(
                json.dumps({"peft_type": "TOY", "base_model": ad.base, "r": ad.lora.rank})
            )
            if optimizer:
                if ad.family == "dimuon":
                    state = {f"mu.{k}": v for k, v in ad.m.items()}
                else:
                    state = {f"m.{k}": v for k, v in ad.m.items()}
                    state |= {f"v.{k}": v for k, v in ad.v.items()}
                state["step"] = np.array([ad.step], np.int64)
                save_file(state, str(folder / OPTIMIZER))

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        tensors = load_file(str(folder / ADAPTER))
        opt = load_file(str(folder / OPTIMIZER)) if optimizer else None
        with self._lock:
            ad = self._get(model_id)
            if tensors["lora_A"].shape != ad.a.shape:
                raise InvalidTrainingRequest("checkpoint adapter shape differs from the run's")
            ad.a, ad.b = tensors["lora_A"].copy(), tensors["lora_B"].copy()
            ad.grad_a.fill(0)
            ad.grad_b.fill(0)
            if opt is not None:
                dimuon = any(k.startswith("mu.") for k in opt)
                ad.family = "dimuon" if dimuon else "adamw"
                prefix = "mu." if dimuon else "m."
                ad.m = {k[len(prefix) :]: v.copy() for k, v in opt.items() if k.startswith(prefix)}
                ad.v = {k[2:]: v.copy() for k, v in opt.items() if k.startswith("v.")}
                ad.step = int(opt["step"][0])
            else:
                ad.m, ad.v, ad.step, ad.family = {}, {}, 0, "adamw"

    def release(self, model_id: str) -> None:
        with self._lock:
            self._adapters.pop(model_id, None)

    # --- SamplingBackend --------------------------------------------------------------

    async def sample(
        self, source: WeightsSource, request: SampleRequest, *, tenant: str = ""
    ) -> TinkerSampleResult:
        self._check_base(source.base_model)
        w = self._weights(source)
        params, topk_prompt = request.params, request.topk_prompt
        x = self._tokens(request.prompt, "prompt")
        if len(x) + params.max_tokens > self._info.max_context_length:
            raise InvalidTrainingRequest(
                f"prompt ({len(x)} tokens) + max_tokens ({params.max_tokens}) exceed the "
                f"context length {self._info.max_context_length}"
            )
        if params.stop_strings and self._decode is None:
            raise UnsupportedFeatureError("the toy model has no tokenizer: stop by token ids")
        rng = np.random.default_rng(params.seed)
        stops = (
            set(params.stop_token_ids)
            if params.stop_token_ids is not None
            else (set() if params.stop_strings is not None else {self.eos})
        )
        sequences = [
            self._sample_one(w, int(x[-1]), params, stops, rng, request.topk_sample)
            for _ in range(request.num_samples)
        ]
        scored: list[float | None] | None = None
        alternatives: list[TopK | None] | None = None
        targets, alt = request.target_prompt, request.prompt_alt_k
        if not (request.prompt_logprobs or topk_prompt or targets is not None or alt):
            return TinkerSampleResult(sequences)
        logits = self._embed[x[:-1]] @ w
        all_lp = logits - _logsumexp(logits)
        lp = all_lp[np.arange(len(x) - 1), x[1:]]
        if request.prompt_logprobs or topk_prompt:
            scored = [None, *(float(v) for v in lp)]
        if topk_prompt:
            alternatives = [None, *(_top(row, topk_prompt) for row in all_lp)]
        target_lp = None
        if targets is not None:
            rows = targets.row_ids()
            if any(t >= self.vocab_size for row in rows for t in row):
                raise InvalidTrainingRequest(
                    f"target_prompt_logprobs: token ids must be in 0..{self.vocab_size - 1}"
                )
            target_lp = targets.scored(
                [{t: float(all_lp[r, t]) for t in ids} for r, ids in enumerate(rows)]
            )
        draws = _draws(all_lp, params, alt) if alt else None
        return TinkerSampleResult(sequences, scored, alternatives, target_lp, draws)

    def _sample_one(
        self,
        w: np.ndarray,
        last: int,
        params: TinkerSamplingParams,
        stops: set[int],
        rng: np.random.Generator,
        topk: int,
    ) -> SampledSequence:
        tokens: list[int] = []
        logprobs: list[float] = []
        alternatives: list[TopK] = []
        stopped = False
        for _ in range(params.max_tokens):
            logits = self._embed[last] @ w
            logp = logits - _logsumexp(logits[None])[0]
            token = _pick(logp, params, rng)
            tokens.append(token)
            logprobs.append(float(logp[token]))
            alternatives.append(_top(logp, topk))
            last = token
            stopped = token in stops or bool(
                params.stop_strings
                and self._decode is not None
                and any(s in self._decode(tokens) for s in params.stop_strings)
            )
            if stopped:
                break
        reason: Literal["stop", "length"] = "stop" if stopped else "length"
        return SampledSequence(tokens, logprobs, reason, alternatives if topk else None)

    def _weights(self, source: WeightsSource) -> np.ndarray:
        if source.model_id is not None:
            with self._lock:
                ad = self._get(source.model_id)
                return self._unembed + ad.a @ ad.b
        if source.path is not None:
            tensors = load_file(str(source.path / ADAPTER))
            return self._unembed + tensors["lora_A"] @ tensors["lora_B"]
        return self._unembed

    # --- helpers ----------------------------------------------------------------------

    def _get(self, model_id: str) -> _ToyAdapter:
        ad = self._adapters.get(model_id)
        if ad is None:
            raise NotFoundError(f"model {model_id!r} is not loaded")
        return ad

    def _check_base(self, name: str) -> None:
        if name != self._info.name and name not in self._info.aliases:
            raise InvalidTrainingRequest(f"base model {name!r} is not served")

    def _tokens(self, tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        x = np.asarray(tokens, dtype=np.int64)
        if x.ndim != 1 or len(x) == 0:
            raise InvalidTrainingRequest(f"{what}: needs at least one token")
        if x.min() < 0 or x.max() >= self.vocab_size:
            raise InvalidTrainingRequest(f"{what}: token ids must be in 0..{self.vocab_size - 1}")
        return x


def _inputs(datum: Datum, loss_fn: str, length: int) -> dict[str, np.ndarray]:
    """The loss's inputs as arrays (checked by ``check_data``; weights default to 1)."""
    out: dict[str, np.ndarray] = {"weights": np.ones(length)}
    for key in LOSS_INPUTS[loss_fn]:
        value = datum.loss_fn_inputs.get(key)
        if value is not None:
            arr = np.frombuffer(
                value.data, dtype=np.int64 if value.dtype == "int64" else np.float32
            )
            out[key] = arr if key == "target_tokens" else arr.astype(np.float64)
    return out


def _loss(
    loss_fn: str, logp: np.ndarray, inputs: dict[str, np.ndarray], config: Mapping[str, float]
) -> tuple[float, np.ndarray]:
    """The loss (a sum over tokens) and its gradient with respect to each target logprob."""
    if loss_fn == "cross_entropy":
        w = inputs["weights"]
        return float(-(w * logp).sum()), -w
    config = loss_config(loss_fn, config)  # Tinker's defaults; the thresholds bound r
    q, adv = inputs["logprobs"], inputs["advantages"]
    ratio = np.exp(logp - q)
    low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 0.0)
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum()), -ratio * adv
    if loss_fn == "ppo":
        clipped = np.clip(ratio, low, high)
        unclipped_wins = ratio * adv <= clipped * adv
        obj = np.where(unclipped_wins, ratio * adv, clipped * adv)
        return float(-obj.sum()), np.where(unclipped_wins, -ratio * adv, 0.0)
    if loss_fn == "cispo":
        clipped = np.clip(ratio, low, high)
        return float(-(clipped * logp * adv).sum()), -clipped * adv
    if loss_fn == "gspo":  # one datum: its ratio's value on every token, each own gradient
        marked = inputs["sequence_ratio_mask"] != 0
        log_ratio = float((logp - q)[marked].mean()) if marked.any() else 0.0
        ratio = np.full_like(logp, np.exp(log_ratio))
        clipped = np.clip(ratio, low, high)
        unclipped_wins = ratio * adv <= clipped * adv
        obj = np.where(unclipped_wins, ratio * adv, clipped * adv)
        return float(-obj.sum()), np.where(unclipped_wins, -ratio * adv, 0.0)
    if loss_fn == "stable_reinforce":  # q: the recorded sampler logprobs
        mask = inputs["sampled_mask"]
        log_ratio = (logp - q) * mask
        ratio = np.exp(log_ratio)
        lo, hi = STABLE_REINFORCE_TRUST
        trusted = ((ratio >= lo) & (ratio <= hi)) * mask
        kl = config["kl_coeff"]
        value = -(trusted * ratio * adv).sum() + kl * (mask * (ratio - 1 - log_ratio)).sum()
        return float(value), -trusted * ratio * adv + kl * mask * (ratio - 1)
    if loss_fn == "dro":
        beta = config["beta"]
        obj = logp * adv - 0.5 * beta * (logp - q) ** 2
        return float(-obj.sum()), -(adv - beta * (logp - q))
    raise InvalidTrainingRequest(f"loss_fn {loss_fn!r} is not supported")


# Dimuon's constants, as the LoRA backend's (adapters/torch/lora/dimuon.py documents them).
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_DAMPING = 0.1
_EPS = 1e-7


def _dimuon_direction(momentum: np.ndarray) -> np.ndarray:
    """Dimuon's update direction of a momentum matrix, float32: row/column-preconditioned,
    orthogonalized by Newton–Schulz, Frobenius norm sqrt(min(shape))."""
    x = momentum.astype(np.float32)
    x = x / (np.abs(x).max() + np.float32(1e-30))
    x = x / np.sqrt(np.mean(x * x) + np.float32(1e-30))
    sq = x * x
    rows = (sq.mean(axis=1, keepdims=True) + np.float32(_DAMPING)) ** np.float32(-0.25)
    cols = (sq.mean(axis=0, keepdims=True) + np.float32(_DAMPING)) ** np.float32(-0.25)
    y = x * rows * cols
    tall = y.shape[0] > y.shape[1]
    y = y.T if tall else y
    y = y / (np.linalg.norm(y) + np.float32(_EPS))
    a, b, c = (np.float32(v) for v in _NS_COEFFICIENTS)
    for _ in range(_NS_STEPS):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    o = y.T if tall else y
    scale = np.float32(np.sqrt(min(o.shape))) / (np.linalg.norm(o) + np.float32(_EPS))
    return (o * scale).astype(np.float32)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _top(logp: np.ndarray, k: int) -> TopK:
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(logp[i])) for i in order]


def _draws(all_lp: np.ndarray, params: TinkerSamplingParams, k: int) -> PromptAltTokens:
    """``k`` draws per prompt row at the temperature alone (greedy: the argmax), from a
    stream of their own (the sequences' stay as they are)."""
    rng = np.random.default_rng(None if params.seed is None else [params.seed, 1])
    tokens, logprobs = [], []
    for logp in all_lp:
        if params.temperature == 0:
            ids = np.full(k, logp.argmax())
        else:
            p = np.exp((logp - logp.max()) / params.temperature)
            ids = rng.choice(len(logp), size=k, p=p / p.sum())
        tokens.append([int(t) for t in ids])
        logprobs.append([float(logp[t]) for t in ids])
    return PromptAltTokens(k, tokens, logprobs)


def _pick(logp: np.ndarray, params: TinkerSamplingParams, rng: np.random.Generator) -> int:
    if params.temperature == 0:
        return int(logp.argmax())
    z = logp / params.temperature
    order: np.ndarray = np.argsort(-z)
    if params.top_k > 0:
        order = order[: params.top_k]
    p: np.ndarray = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if params.top_p < 1:
        keep = np.searchsorted(np.cumsum(p), params.top_p) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(rng.choice(order, p=p))
