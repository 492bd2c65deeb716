"""The custom-loss interpreter (adapters/torch/lora/custom_loss.py): losses traced and encoded
by the stock SDK, as it uploads them, give the Python function's value and gradient;
graphs that pass the upload checks but misbehave at run time are refused naming the node,
before anything big is made; the LoRA backend trains with a custom loss as with the
built-in loss it spells."""

import builtins
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from torch.testing import assert_close

import adapters.torch.lora.custom_loss as interpreter
from adapters.torch.lora.custom_loss import (
    FUNCTION_TABLE,
    METHOD_TABLE,
    custom_loss_gradient,
    run_custom_loss,
    wire_name,
)
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.custom_loss import (
    FUNCTIONS,
    GETATTR,
    METHODS,
    Call,
    CustomLoss,
    CustomLossInput,
    RawNode,
    Ref,
    parse_custom_loss,
)
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import AdamParams, Datum, LoraSpec, TensorValue
from tests.support.tiny_models import VOCAB, save_tiny_model


def uploaded(fn: Any, ranks: dict[str, types.CustomLossInputRank]) -> CustomLoss:
    """``fn`` as the server gets it: traced and encoded by the SDK, through JSON, parsed."""
    handle = trace_loss(fn, ranks, "session")
    graph = types.CreateCustomLossRequest(
        session_id="s",
        custom_loss_seq_id=0,
        name=handle.name,
        inputs=list(handle.inputs),
        graph=encode_graph(handle),
    ).model_dump(mode="json")
    nodes = [
        RawNode(n["op"], n["name"], n["target"], n.get("args", []), n.get("kwargs", {}))
        for n in graph["graph"]["nodes"]
    ]
    inputs = [(i["name"], i["rank"]) for i in graph["inputs"]]
    return parse_custom_loss(graph["name"], inputs, nodes, graph["graph"]["format"])


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/tokens:mean": (weights > 0).float().sum()}


def dpo_pair(logprobs, chosen_mask, rejected_mask, ref_chosen, ref_rejected):
    """The cookbook's DPO loss (preference/train_dpo.py) for one datum holding a chosen
    and a rejected completion: their weighted logprob sums against the reference's."""
    chosen = torch.dot(logprobs.float(), chosen_mask.float()) - ref_chosen
    rejected = torch.dot(logprobs.float(), rejected_mask.float()) - ref_rejected
    beta = 0.1
    loss = -F.logsigmoid(beta * (chosen - rejected))
    metrics = {
        "custom/dpo_loss:mean": loss,
        "custom/accuracy:mean": (chosen > rejected).float(),
        "custom/margin:mean": beta * (chosen - rejected),
    }
    return loss, metrics


def clipped_ratio(logprobs, sampler_logprobs, advantages, mask):
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -(objective * mask).sum() / mask.sum().clamp_min(1.0)
    clip_frac = ((ratio - clipped).abs() > 0).float().mean()
    return loss, {"custom/ppo:sum": loss, "custom/clip_frac:mean": clip_frac}


def shapes_and_masks(logprobs, ref_topk, temperature):
    """Shapes, slices, broadcasting, a boolean mask (size known only once computed), a
    rank-2 and a rank-0 input, factories, reductions along a dim, stop-gradient."""
    n = logprobs.shape[0]
    k = ref_topk.size(-1)
    position = torch.arange(n, dtype=torch.float32) / n
    discount = torch.exp(-position * temperature)
    lse = torch.logsumexp(ref_topk / temperature, dim=-1)
    kl = F.kl_div(
        logprobs[:, None].expand(-1, k), ref_topk, reduction="sum", log_target=True
    ) / math.sqrt(k)
    confident = logprobs[logprobs > -3.0]
    baseline = logprobs.detach().mean()
    head = logprobs[: n // 2].sum() + torch.where(logprobs > baseline, logprobs, 0.0).sum()
    loss = -(logprobs * discount).sum() + 0.01 * kl + 0.1 * head + (lse**2).mean() * 1e-3
    loss = loss + torch.zeros_like(logprobs).sum() + confident.sum() * 0.5
    return loss, {"custom/kl:mean": kl, "custom/confident:sum": confident.numel()}


RNG = np.random.default_rng(0)
T = 9


def tensor(*shape: int, low: float = -4.0, high: float = 0.0) -> torch.Tensor:
    return torch.tensor(RNG.uniform(low, high, shape), dtype=torch.float32)


CASES = {
    "weighted_nll": (weighted_nll, {"logprobs": 1, "weights": 1}, [tensor(T, low=0, high=1)]),
    "dpo_pair": (
        dpo_pair,
        {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_chosen": 0, "ref_rejected": 0},
        [
            torch.tensor([1.0] * 4 + [0.0] * 5),
            torch.tensor([0.0] * 4 + [1.0] * 5),
            torch.tensor(-7.0),
            torch.tensor(-9.5),
        ],
    ),
    "clipped_ratio": (
        clipped_ratio,
        {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1, "mask": 1},
        [tensor(T), tensor(T, low=-1, high=1), torch.tensor([1.0] * 7 + [0.0] * 2)],
    ),
    "shapes_and_masks": (
        shapes_and_masks,
        {"logprobs": 1, "ref_topk": 2, "temperature": 0},
        [tensor(T, 3), torch.tensor(0.7)],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_an_uploaded_loss_gives_the_functions_value_and_gradient(case: str) -> None:
    fn, ranks, inputs = CASES[case]
    loss = uploaded(fn, ranks)
    logprobs = tensor(T)
    mine = logprobs.clone().requires_grad_()
    value, metrics = run_custom_loss(loss, mine, inputs)
    value.backward()
    theirs = logprobs.clone().requires_grad_()
    expected, expected_metrics = fn(theirs, *inputs)
    expected.backward()
    assert_close(value, expected)
    assert_close(mine.grad, theirs.grad)
    assert mine.grad is not None and mine.grad.abs().sum() > 0
    assert metrics == pytest.approx(
        {k: float(torch.as_tensor(v).detach()) for k, v in expected_metrics.items()}
    )


def test_the_gradient_port_matches_autograd_on_the_function() -> None:
    loss = uploaded(
        clipped_ratio, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1, "mask": 1}
    )
    logprobs = tensor(T)
    q, a, mask = CASES["clipped_ratio"][2]
    datum = Datum(
        list(range(T)),
        {
            "target_tokens": TensorValue.ints(list(range(T))),
            "sampler_logprobs": TensorValue.floats(q.tolist()),
            "advantages": TensorValue.floats(a.tolist()),
            "mask": TensorValue.floats(mask.tolist()),
        },
    )
    value, grad, metrics = custom_loss_gradient(loss, logprobs.tolist(), datum, 0)
    theirs = logprobs.clone().requires_grad_()
    expected, _ = clipped_ratio(theirs, q, a, mask)
    expected.backward()
    assert value == pytest.approx(float(expected))
    assert grad == pytest.approx(theirs.grad.tolist(), abs=1e-6)
    assert set(metrics) == {"custom/ppo:sum", "custom/clip_frac:mean"}


def test_the_tables_hold_exactly_the_domains_allow_lists() -> None:
    assert set(FUNCTION_TABLE) == FUNCTIONS - {GETATTR}
    assert set(METHOD_TABLE) == METHODS
    for name, fn in FUNCTION_TABLE.items():
        assert wire_name(fn) == name  # the name the SDK sends for it
    assert builtins.eval not in FUNCTION_TABLE.values()
    assert not [m for m in METHODS if m.endswith("_") or m.startswith("_")]


# --- refused at run time ----------------------------------------------------------------


def graph(*calls: Call, loss: str, inputs: int = 1) -> CustomLoss:
    names = ["logprobs", "weights"][:inputs]
    return CustomLoss("hostile", tuple(CustomLossInput(n, 1) for n in names), calls, Ref(loss), ())


def fn(name: str, target: str, *args: Any, **kwargs: Any) -> Call:
    return Call("call_function", name, target, args, tuple(kwargs.items()))


def method(name: str, target: str, *args: Any, **kwargs: Any) -> Call:
    return Call("call_method", name, target, args, tuple(kwargs.items()))


def refused(loss: CustomLoss, *words: str, logprobs: torch.Tensor | None = None) -> None:
    with pytest.raises(InvalidTrainingRequest) as info:
        run_custom_loss(loss, tensor(T) if logprobs is None else logprobs, [])
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_name_not_in_the_tables_is_never_run(monkeypatch) -> None:
    """A loss built past the upload checks: the interpreter still only knows its tables."""
    called = []
    monkeypatch.setattr(builtins, "eval", lambda *a: called.append(a))
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(a))
    for target in ("builtins.eval", "eval", "torch.load", "os.system"):
        refused(graph(fn("x", target, "1+1"), loss="x"), "node 'x'", "not an operation")
    refused(graph(method("x", "__reduce_ex__", Ref("logprobs"), 2), loss="x"), "not an operation")
    refused(graph(fn("x", "getattr", Ref("logprobs"), "__class__"), loss="x"), "not allowed")
    refused(graph(fn("x", "getattr", "os", "system"), loss="x"), "not allowed")
    refused(graph(fn("x", "operator.neg", Ref("later")), loss="x"), "refers to 'later'")
    refused(graph(loss="nothing"), "refers to 'nothing'")
    assert called == []


def test_sizes_are_refused_before_anything_that_big_is_made() -> None:
    big = 1 << 40  # 4 TiB of float32, were it allocated
    refused(graph(fn("z", "torch.zeros", big), loss="z"), "node 'z'", "elements")
    refused(graph(method("e", "expand", Ref("logprobs"), big, T), loss="e"), "elements")
    refused(graph(method("r", "new_ones", Ref("logprobs"), (big,)), loss="r"), "elements")
    # Broadcasting two [T] vectors into [T, T]: too big for a long datum, fine for a short one.
    outer = [
        fn("a", "operator.getitem", Ref("logprobs"), (slice(None), None)),
        fn("b", "operator.getitem", Ref("logprobs"), (None, slice(None))),
        fn("c", "operator.mul", Ref("a"), Ref("b")),
        method("d", "sum", Ref("c")),
    ]
    with pytest.raises(InvalidTrainingRequest, match=r"node 'c' .* elements"):
        run_custom_loss(graph(*outer, loss="d"), torch.zeros(5000), [])
    value, _ = run_custom_loss(graph(*outer, loss="d"), torch.ones(T), [])
    assert float(value) == T * T


def test_a_datums_values_together_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(interpreter, "MAX_DATUM_ELEMENTS", 4 * T)
    calls = [fn(f"n{i}", "operator.neg", Ref("logprobs")) for i in range(5)]
    refused(graph(*calls, method("s", "sum", Ref("n4")), loss="s"), "node 'n4'", "per datum")


def test_python_values_are_bounded_and_typed() -> None:
    refused(graph(fn("p", "operator.pow", 10, 10**9), loss="p"), "integer power")
    refused(graph(fn("m", "operator.mul", 2**62, 2**62), loss="m"), "int64 range")
    refused(graph(fn("m", "operator.mul", "a", 10**9), loss="m"), "takes numbers or tensors")
    refused(graph(fn("m", "operator.add", (1,), (2,)), loss="m"), "takes numbers or tensors")
    refused(graph(fn("d", "operator.truediv", 1, 0), loss="d"), "node 'd'", "ZeroDivisionError")
    shape = fn("s", "getattr", Ref("logprobs"), "shape")
    refused(graph(shape, method("x", "sum", Ref("s")), loss="x"), "called on a Size")


def test_devices_are_the_servers() -> None:
    to_cuda = method("c", "to", Ref("logprobs"), "cuda:1")
    refused(graph(to_cuda, loss="c"), "node 'c'", "to() takes a dtype")
    # A device named in a factory or a method's keyword is replaced by the loss's own.
    made = fn("t", "torch.tensor", 2.0, device="cuda:7")
    ones = method("o", "new_ones", Ref("logprobs"), (), device="cuda:3")
    total = fn("s", "operator.mul", Ref("t"), Ref("o"))
    value, _ = run_custom_loss(graph(made, ones, total, loss="s"), tensor(T), [])
    assert value.device.type == "cpu" and float(value) == 2.0


def test_a_bad_result_is_refused() -> None:
    refused(graph(loss="logprobs"), "0-d floating-point tensor")
    inf = [method("s", "sum", Ref("logprobs")), fn("d", "operator.truediv", Ref("s"), 0.0)]
    refused(graph(*inf, loss="d"), "non-finite loss")
    mismatch = fn("m", "operator.mul", Ref("logprobs"), Ref("weights"))
    with pytest.raises(InvalidTrainingRequest, match=r"node 'm' \(operator.mul\) failed"):
        run_custom_loss(graph(mismatch, loss="m", inputs=2), tensor(T), [tensor(T + 1)])


def test_a_non_finite_gradient_is_refused() -> None:
    """sqrt at 0: a finite loss whose gradient is infinite."""
    loss = graph(
        fn("z", "operator.mul", Ref("logprobs"), 0.0),
        fn("r", "torch.sqrt", Ref("z")),
        method("s", "sum", Ref("r")),
        loss="s",
    )
    datum = Datum([1] * T, {"target_tokens": TensorValue.ints([1] * T)})
    with pytest.raises(InvalidTrainingRequest, match=r"gradient .* is not finite"):
        custom_loss_gradient(loss, tensor(T).tolist(), datum, 0)


UNARY = (
    "abs neg sign exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square reciprocal "
    "sigmoid tanh relu erf floor ceil round trunc nan_to_num isfinite isnan isinf "
    "logical_not sum mean nansum nanmean prod std var amax amin argmax argmin "
    "logsumexp all any count_nonzero flatten log_sigmoid softplus gelu"
)


def test_every_listed_function_runs_on_meta_or_is_value_dependent() -> None:
    """The size check runs each operation on meta tensors first: every elementwise and
    reduction function on the list has a meta kernel (no operation is refused for want
    of one)."""
    x = torch.rand(4, 3)
    unary = [
        name
        for name in FUNCTION_TABLE
        if name.startswith("torch.") and name.split(".")[-1] in UNARY.split()
    ]
    assert len(unary) > 30
    for name in unary:
        kwargs = {"dim": 0} if name.endswith("logsumexp") else {}
        FUNCTION_TABLE[name](x.to("meta"), **kwargs)


# --- the LoRA backend -------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> LoraTrainingBackend:
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return LoraTrainingBackend([BaseModelEntry("llama", folder, dtype=torch.float32)])


def _data(extra: dict[str, list[list[float]]]) -> list[Datum]:
    rng = np.random.default_rng(3)
    data = []
    for i, n in enumerate((12, 7, 9)):
        seq = rng.integers(0, VOCAB, n + 1).tolist()
        inputs = {"target_tokens": TensorValue.ints(seq[1:])}
        inputs |= {k: TensorValue.floats(v[i][:n]) for k, v in extra.items()}
        data.append(Datum(seq[:-1], inputs))
    return data


def _grads(backend: LoraTrainingBackend, model_id: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in backend._adapters[model_id].params if p.grad is not None]


_ids = iter(range(1000))


def _run(backend, batch: ForwardBackwardInput) -> tuple[dict[str, float], list[torch.Tensor]]:
    model_id = f"m{next(_ids)}"
    backend.create(model_id, "llama", LoraSpec(rank=4, seed=1))
    # A step first, so B is not zero and every LoRA weight gets a gradient.
    warm = ForwardBackwardInput(_data({}), "cross_entropy")
    backend.forward_backward(model_id, warm, backward=True)
    backend.optim_step(model_id, AdamParams(0.01))
    result = backend.forward_backward(model_id, batch, backward=True)
    return result.metrics, _grads(backend, model_id)


def test_lora_training_with_a_custom_loss_equals_the_builtin_it_spells(backend) -> None:
    rng = np.random.default_rng(4)
    weights = rng.uniform(0, 1, (3, 12)).tolist()
    data = _data({"weights": weights})
    loss = uploaded(weighted_nll, {"logprobs": 1, "weights": 1})
    custom, custom_grads = _run(backend, ForwardBackwardInput(data, "custom", custom_loss=loss))
    builtin, builtin_grads = _run(backend, ForwardBackwardInput(data, "cross_entropy"))
    assert custom["loss:sum"] == pytest.approx(builtin["loss:sum"], rel=1e-5)
    assert custom["custom/nll:sum"] == pytest.approx(builtin["loss:sum"], rel=1e-5)
    assert custom["custom/tokens:mean"] == pytest.approx((12 + 7 + 9) / 3)
    assert len(custom_grads) == len(builtin_grads) > 0
    for mine, theirs in zip(custom_grads, builtin_grads, strict=True):
        assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_lora_ppo_as_a_custom_loss_equals_the_builtin_ppo(backend) -> None:
    def ppo(logprobs, logprobs_sampler, advantages):
        ratio = torch.exp(logprobs - logprobs_sampler)
        clipped = ratio.clamp(0.8, 1.2)
        return -torch.minimum(ratio * advantages, clipped * advantages).sum(), {}

    rng = np.random.default_rng(5)
    q = rng.uniform(-8, -4, (3, 12)).tolist()
    a = rng.uniform(-1, 1, (3, 12)).tolist()
    custom_data = _data({"logprobs_sampler": q, "advantages": a})
    builtin_data = _data({"logprobs": q, "advantages": a})
    loss = uploaded(ppo, {"logprobs": 1, "logprobs_sampler": 1, "advantages": 1})
    custom, custom_grads = _run(
        backend, ForwardBackwardInput(custom_data, "custom", custom_loss=loss)
    )
    builtin, builtin_grads = _run(backend, ForwardBackwardInput(builtin_data, "ppo", {}))
    assert custom["loss:sum"] == pytest.approx(builtin["loss:sum"], rel=1e-5)
    for mine, theirs in zip(custom_grads, builtin_grads, strict=True):
        assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_lora_refuses_a_non_finite_gradient_before_the_adapter_gets_any(backend) -> None:
    def sqrt_at_zero(logprobs):
        loss = torch.sqrt(logprobs * 0.0).sum()
        return loss, {}

    loss = uploaded(sqrt_at_zero, {"logprobs": 1})
    backend.create("bad", "llama", LoraSpec(rank=4, seed=1))
    batch = ForwardBackwardInput(_data({}), "custom", custom_loss=loss)
    with pytest.raises(InvalidTrainingRequest, match="not finite"):
        backend.forward_backward("bad", batch, backward=True)
    assert _grads(backend, "bad") == []
    forward = backend.forward_backward("bad", batch, backward=False)  # no gradient: fine
    assert forward.metrics["loss:sum"] == 0.0
