"""Uploaded custom-loss graphs (domain/tinker/custom_loss.py): what parses, and every hostile or
malformed graph refused with an error naming the problem. Pure data: nothing here can
run, and nothing does."""

from array import array
from typing import Any

import pytest

from application.tinker.custom_losses import CustomLossStore
from domain.tinker.custom_loss import (
    MAX_ARG_DEPTH,
    MAX_CALLS_PER_REQUEST,
    MAX_INPUTS,
    MAX_NODES,
    Constant,
    CustomLoss,
    DictArg,
    ListArg,
    RawNode,
    Ref,
    SliceArg,
    check_custom_data,
    parse_custom_loss,
    reduce_metrics,
    split_loss_config,
)
from domain.tinker.errors import (
    InvalidTrainingRequest,
    NotFoundError,
    SequenceConflictError,
    TrainingError,
    UnsupportedFeatureError,
)
from domain.tinker.values import Datum, TensorValue

INPUTS = [("logprobs", 1), ("weights", 1)]


def node(op: str, name: str, target: str, *args: Any, **kwargs: Any) -> RawNode:
    return RawNode(op, name, target, list(args), kwargs)


def placeholders(inputs: list[tuple[str, int]] = INPUTS) -> list[RawNode]:
    return [node("placeholder", n, n) for n, _ in inputs]


def output(loss: str = "neg", metrics: dict[str, str] | None = None) -> RawNode:
    metrics = {"custom/nll:sum": loss} if metrics is None else metrics
    encoded = {k: {"ref": v} for k, v in metrics.items()}
    return node("output", "output", "output", {"tuple": [{"ref": loss}, {"dict": encoded}]})


def weighted_nll(*body: RawNode) -> list[RawNode]:
    """-(logprobs * weights).sum(), with ``body`` inserted before the output."""
    return [
        *placeholders(),
        node("call_function", "mul", "operator.mul", {"ref": "logprobs"}, {"ref": "weights"}),
        node("call_method", "sum_1", "sum", {"ref": "mul"}),
        node("call_function", "neg", "operator.neg", {"ref": "sum_1"}),
        *body,
        output(),
    ]


def parse(nodes: list[RawNode], inputs: list[tuple[str, int]] = INPUTS) -> CustomLoss:
    return parse_custom_loss("loss", inputs, nodes)


def refused(nodes: list[RawNode], *words: str, inputs: list[tuple[str, int]] = INPUTS) -> str:
    with pytest.raises(InvalidTrainingRequest) as info:
        parse(nodes, inputs)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_a_traced_loss_parses_into_typed_arguments() -> None:
    loss = parse(
        weighted_nll(
            node("call_function", "getattr_1", "getattr", {"ref": "logprobs"}, "shape"),
            node(
                "call_function",
                "getitem",
                "operator.getitem",
                {"ref": "logprobs"},
                {"tuple": [{"slice": [1, None, None]}, {"ellipsis": True}]},
            ),
            node(
                "call_function",
                "clamp",
                "torch.clamp",
                {"ref": "logprobs"},
                min={"float": "-inf"},
                max=0.0,
            ),
            node("call_method", "to", "to", {"ref": "clamp"}, {"dtype": "float32"}),
            node("call_function", "stack", "torch.stack", [{"ref": "neg"}, {"ref": "neg"}]),
        )
    )
    assert [i.name for i in loss.datum_inputs] == ["weights"]
    assert loss.loss == Ref("neg") and loss.metrics == (("custom/nll:sum", Ref("neg")),)
    calls = {c.name: c for c in loss.calls}
    assert calls["getitem"].args[1] == (SliceArg(1, None, None), ...)
    assert dict(calls["clamp"].kwargs) == {"min": float("-inf"), "max": 0.0}
    assert calls["to"].args[1] == Constant("dtype", "float32")
    assert calls["stack"].args[0] == ListArg((Ref("neg"), Ref("neg")))


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("builtins.eval", "'builtins.eval'"),
        ("builtins.exec", "'builtins.exec'"),
        ("builtins.__import__", "'builtins.__import__'"),
        ("os.system", "'os.system'"),
        ("subprocess.check_output", "'subprocess.check_output'"),
        ("torch.load", "'torch.load'"),
        ("torch.save", "'torch.save'"),
        ("torch.from_file", "'torch.from_file'"),
        ("torch.empty", "'torch.empty'"),  # uninitialised memory
        ("torch.manual_seed", "'torch.manual_seed'"),
        ("torch.ops.aten.add", "'torch.ops.aten.add'"),
        ("builtins.getattr", "'builtins.getattr'"),
        ("operator.attrgetter", "'operator.attrgetter'"),
        ("operator.setitem", "'operator.setitem'"),
        ("operator.iadd", "'operator.iadd'"),
        ("math.factorial", "'math.factorial'"),
        ("pickle.loads", "'pickle.loads'"),
        ("torch.nn.functional.relu", "'torch.nn.functional.relu'"),  # takes inplace
        ("no.such.op", "'no.such.op'"),
    ],
)
def test_a_function_off_the_list_is_refused_by_name(target: str, shown: str) -> None:
    bad = node("call_function", "bad", target, {"ref": "logprobs"})
    refused(weighted_nll(bad), "node 'bad'", shown, "not an allowed function")


@pytest.mark.parametrize(
    "method",
    [
        "__reduce_ex__",
        "__class__",
        "__getattribute__",
        "numpy",
        "tolist",
        "item",
        "backward",
        "register_hook",
        "data_ptr",
        "untyped_storage",
        "copy_",
        "add_",
        "cuda",
        "type",
        "apply_",
        "new_empty",
    ],
)
def test_a_method_off_the_list_is_refused_by_name(method: str) -> None:
    bad = node("call_method", "bad", method, {"ref": "logprobs"})
    refused(weighted_nll(bad), "node 'bad'", f"method {method!r}", "not an allowed tensor method")


@pytest.mark.parametrize("attribute", ["__class__", "__dict__", "grad_fn", "data", "_base", "grad"])
def test_getattr_reads_only_listed_attributes(attribute: str) -> None:
    bad = node("call_function", "bad", "getattr", {"ref": "logprobs"}, attribute)
    refused(weighted_nll(bad), "node 'bad'", f"attribute {attribute!r}", "not allowed")


def test_getattr_chains_and_computed_names_are_refused() -> None:
    chain = [
        node("call_function", "cls", "getattr", {"ref": "logprobs"}, "__class__"),
        node("call_function", "mro", "getattr", {"ref": "cls"}, "__mro__"),
    ]
    refused(weighted_nll(*chain), "node 'cls'", "'__class__'")
    # The attribute name must be a constant, never another node's value.
    computed = node("call_function", "bad", "getattr", {"ref": "logprobs"}, {"ref": "sum_1"})
    refused(weighted_nll(computed), "node 'bad'", "not allowed")
    # A method may only be called on a node, not on a constant string.
    on_string = node("call_method", "bad", "sum", "os")
    refused(weighted_nll(on_string), "node 'bad'", "needs the value it is called on")


def test_modules_and_captured_attributes_are_refused() -> None:
    module = node("call_module", "lin", "linear", {"ref": "logprobs"})
    refused(weighted_nll(module), "node 'lin'", "calls module 'linear'")
    attr = node("get_attr", "w", "weight")
    refused(weighted_nll(attr), "node 'w'", "reads 'weight'")
    odd = node("call_something", "x", "torch.exp", {"ref": "logprobs"})
    refused(weighted_nll(odd), "node 'x'", "unknown node op")


def test_out_and_inplace_arguments_are_refused() -> None:
    out = node("call_function", "e", "torch.exp", {"ref": "logprobs"}, out={"ref": "weights"})
    refused(weighted_nll(out), "node 'e'", "out=")
    inplace = node("call_function", "s", "torch._C._nn.softplus", {"ref": "mul"}, inplace=True)
    refused(weighted_nll(inplace), "node 's'", "inplace=")


def test_forward_references_cycles_and_unknown_names_are_refused() -> None:
    forward = [
        *placeholders(),
        node("call_function", "a", "operator.neg", {"ref": "b"}),
        node("call_function", "b", "operator.neg", {"ref": "a"}),
        output("b"),
    ]
    refused(forward, "node 'a'", "refers to 'b'", "not a node computed before it")
    self_ref = [
        *placeholders(),
        node("call_function", "a", "operator.neg", {"ref": "a"}),
        output("a"),
    ]
    refused(self_ref, "node 'a'", "refers to 'a'")
    to_output = [*weighted_nll()[:-1], output("output")]
    refused(to_output, "refers to 'output'")
    dup = weighted_nll(node("call_function", "neg", "operator.neg", {"ref": "mul"}))
    refused(dup, "node 'neg'", "used twice")
    shadow = weighted_nll(node("call_function", "weights", "operator.neg", {"ref": "mul"}))
    refused(shadow, "node 'weights'", "used twice")
    bad_name = weighted_nll(node("call_function", "a b", "operator.neg", {"ref": "mul"}))
    refused(bad_name, "identifier")


def test_the_output_node_is_checked() -> None:
    nodes = weighted_nll()
    refused(nodes[:-1], "no output node")
    refused(
        [*nodes, node("call_function", "late", "operator.neg", {"ref": "neg"})], "after the output"
    )
    refused([*nodes[:-1], output(metrics={"loss": "neg"})], "custom/<name>:sum")
    refused([*nodes[:-1], output(metrics={"custom/x:median": "neg"})], "custom/<name>:sum")
    refused([*nodes[:-1], output(metrics={"custom/Upper:sum": "neg"})], "custom/<name>:sum")
    constant_loss = node("output", "output", "output", {"tuple": [1.0, {"dict": {}}]})
    refused([*nodes[:-1], constant_loss], "loss must be a computed tensor")
    one_value = node("output", "output", "output", {"ref": "neg"})
    refused([*nodes[:-1], one_value], "(loss, metrics)")
    constant_metric = node(
        "output", "output", "output", {"tuple": [{"ref": "neg"}, {"dict": {"custom/a:sum": 1}}]}
    )
    refused([*nodes[:-1], constant_metric], "metric 'custom/a:sum'")


def test_inputs_are_checked_against_the_placeholders() -> None:
    refused(weighted_nll(), "2 leading placeholders for 3", inputs=[*INPUTS, ("advantages", 1)])
    refused(weighted_nll(), "placeholder after the inputs", inputs=INPUTS[:1])
    refused(weighted_nll(), "placeholder 1 is 'weights'", inputs=[("logprobs", 1), ("w", 1)])
    refused(
        weighted_nll(), "first input must be logprobs", inputs=[("weights", 1), ("logprobs", 1)]
    )
    refused(weighted_nll(), "rank 3", inputs=[("logprobs", 1), ("weights", 3)])
    refused(weighted_nll(), "rank 1 ([T])", inputs=[("logprobs", 0), ("weights", 1)])
    refused(weighted_nll(), "declared twice", inputs=[("logprobs", 1), ("logprobs", 1)])
    refused(weighted_nll(), "lowercase identifier", inputs=[("logprobs", 1), ("os.path", 1)])
    many = [("logprobs", 1), *((f"x{i}", 1) for i in range(MAX_INPUTS))]
    refused(weighted_nll(), f"{MAX_INPUTS + 1} inputs", inputs=many)
    with pytest.raises(UnsupportedFeatureError, match="rank 2"):
        parse(weighted_nll(), [("logprobs", 2), ("weights", 1)])
    with pytest.raises(InvalidTrainingRequest, match="name"):
        parse_custom_loss("os.system('x')", INPUTS, weighted_nll())
    with pytest.raises(InvalidTrainingRequest, match="format 2"):
        parse_custom_loss("loss", INPUTS, weighted_nll(), graph_format=2)


def test_a_huge_graph_is_refused_by_size() -> None:
    body = [
        node("call_function", f"n{i}", "operator.neg", {"ref": "logprobs"})
        for i in range(MAX_NODES)
    ]
    refused(weighted_nll(*body), f"the most allowed is {MAX_NODES}")


def test_deeply_nested_arguments_are_refused() -> None:
    deep: Any = 1.0
    for _ in range(MAX_ARG_DEPTH + 1):
        deep = [deep]
    refused(weighted_nll(node("call_function", "t", "torch.tensor", deep)), "nest deeper")
    deep_tuple: Any = 1
    for _ in range(MAX_ARG_DEPTH + 1):
        deep_tuple = {"tuple": [deep_tuple]}
    refused(weighted_nll(node("call_function", "t", "torch.tensor", deep_tuple)), "nest deeper")


@pytest.mark.parametrize(
    ("constant", "shown"),
    [
        ({"float": "nan"}, "NaN"),
        ({"float": "1e999"}, "NaN"),
        (float("inf"), "non-finite"),
        (float("nan"), "non-finite"),
        (2**70, "int64"),
        ({"dtype": "object"}, "unknown constant"),
        ({"dtype": "complex128"}, "unknown constant"),
        ({"device": "cuda:0; rm -rf /"}, "unknown constant"),
        ({"layout": "sparse_coo"}, "unknown constant"),
        ({"ref": "x", "tuple": []}, "unknown form"),
        ({"code": "__import__('os')"}, "unknown constant"),
        ({"slice": [1, 2]}, "malformed slice"),
        ("x" * 300, "string constant"),
        ({"ellipsis": False}, "unknown constant"),
    ],
)
def test_bad_constants_are_refused(constant: Any, shown: str) -> None:
    bad = node("call_function", "m", "operator.mul", {"ref": "logprobs"}, constant)
    refused(weighted_nll(bad), "node 'm'", shown)


def test_infinite_constants_are_allowed_in_their_encoded_form() -> None:
    bad = node("call_function", "m", "torch.clamp", {"ref": "logprobs"}, {"float": "-inf"}, 0.0)
    assert parse(weighted_nll(bad)).calls[-1].args[1] == float("-inf")


def test_dict_arguments_keep_their_keys() -> None:
    call = node("call_function", "s", "torch.sum", {"ref": "logprobs"}, {"dict": {"a": 1}})
    assert parse(weighted_nll(call)).calls[-1].args[1] == DictArg((("a", 1),))


# --- data and config ----------------------------------------------------------------------


def datum(n: int = 4, **inputs: TensorValue) -> Datum:
    targets = TensorValue(array("q", range(n)), (n,))
    return Datum(array("i", range(n)), {"target_tokens": targets, **inputs})


def test_data_must_carry_the_inputs_at_their_declared_rank() -> None:
    loss = parse(weighted_nll(), [("logprobs", 1), ("weights", 1)])
    check_custom_data([datum(weights=TensorValue.floats([1.0] * 7))], loss)  # any length
    with pytest.raises(InvalidTrainingRequest, match=r"data\[0\].*'weights'.*missing"):
        check_custom_data([datum()], loss)
    grid = TensorValue(array("f", [1.0] * 4), (2, 2))
    with pytest.raises(InvalidTrainingRequest, match="rank 1"):
        check_custom_data([datum(weights=grid)], loss)
    nan = TensorValue.floats([1.0, float("nan")])
    with pytest.raises(InvalidTrainingRequest, match="finite"):
        check_custom_data([datum(weights=nan)], loss)
    short = Datum(array("i", range(4)), {"target_tokens": TensorValue.ints([1, 2])})
    with pytest.raises(InvalidTrainingRequest, match="target_tokens"):
        check_custom_data([short], loss)
    # Rank 0: one value, which the wire sends without a shape (read as [1]).
    scalar = parse(weighted_nll(), [("logprobs", 1), ("weights", 0)])
    check_custom_data([datum(weights=TensorValue.floats([2.0]))], scalar)
    with pytest.raises(InvalidTrainingRequest, match="rank 0"):
        check_custom_data([datum(weights=TensorValue.floats([2.0, 3.0]))], scalar)


def test_the_operations_of_one_request_are_bounded() -> None:
    loss = parse(weighted_nll(), [("logprobs", 1), ("weights", 0)])
    one = datum(weights=TensorValue.floats([1.0]))
    per_request = MAX_CALLS_PER_REQUEST // len(loss.calls)
    check_custom_data([one] * per_request, loss)
    with pytest.raises(InvalidTrainingRequest, match="fewer data per request"):
        check_custom_data([one] * (per_request + 1), loss)


def test_loss_fn_config_text_is_only_a_custom_loss_id() -> None:
    assert split_loss_config("custom", {"loss_id": "s:loss:0"}) == ({}, "s:loss:0")
    assert split_loss_config("ppo", {"clip_low_threshold": 0.5}) == (
        {"clip_low_threshold": 0.5},
        None,
    )
    with pytest.raises(InvalidTrainingRequest, match="only for loss_fn 'custom'"):
        split_loss_config("ppo", {"clip_low_threshold": "0.5"})
    for bad in ({}, {"loss_id": 1.0}, {"loss_id": "x", "beta": 1.0}):
        with pytest.raises(InvalidTrainingRequest, match="loss_id"):
            split_loss_config("custom", bad)


def test_metrics_reduce_by_their_suffix() -> None:
    sums = {"custom/a:sum": 6.0, "custom/b:mean": 6.0}
    assert reduce_metrics(sums, 3) == {"custom/a:sum": 6.0, "custom/b:mean": 2.0}


def test_the_store_keeps_losses_per_key_and_session() -> None:
    store = CustomLossStore(max_per_key=2)
    loss = parse(weighted_nll())
    other = parse(weighted_nll(node("call_function", "x", "operator.neg", {"ref": "mul"})))
    loss_id = store.create("alice", "s1", 0, loss)
    assert loss_id == "s1:loss:0"
    assert store.create("alice", "s1", 0, loss) == loss_id  # a retry
    with pytest.raises(SequenceConflictError):
        store.create("alice", "s1", 0, other)
    assert store.get("alice", "s1", loss_id) is loss
    with pytest.raises(NotFoundError):
        store.get("bob", "s1", loss_id)  # another key's loss does not exist for it
    with pytest.raises(InvalidTrainingRequest, match="belongs to session 's1'"):
        store.get("alice", "s2", loss_id)
    store.create("alice", "s1", 1, other)
    with pytest.raises(TrainingError, match="the most allowed"):
        store.create("alice", "s2", 0, loss)
    store.create("bob", "s3", 0, loss)  # other keys have their own budget
    store.end_session("s1")
    with pytest.raises(NotFoundError):
        store.get("alice", "s1", loss_id)
    assert store.create("alice", "s2", 0, loss) == "s2:loss:0"
