"""Server-side custom losses (Tinker's ``create_custom_loss``): a per-datum loss the SDK traced
with torch.fx, sent as plain data, parsed and checked here before anything can run it.

The SDK sends the traced graph node for node (``tinker.types.CustomLossGraph``):
placeholders (``logprobs``, then the ``loss_fn_inputs`` keys the loss reads), calls of
functions by qualified name (``torch.exp``, ``operator.mul``, ``getattr``) or of tensor
methods by name, and one output ``(loss, {"custom/<name>:sum|mean": value})``. Arguments
are JSON with one-key objects for references and constants (``{"ref": "sub_1"}``,
``{"dtype": "float32"}``, ``{"float": "-inf"}``...).

:func:`parse_custom_loss` turns that into a :class:`CustomLoss` of typed arguments, or
raises ``InvalidTrainingRequest`` naming the node and the problem: an operation not on
the allow-lists below (``FUNCTIONS``, ``METHODS``, ``ATTRIBUTES``), a reference to a node
not yet computed, a constant that is not one (NaN, a bare non-finite number), a graph past
the size limits. Nothing here runs anything; the interpreter (``adapters/torch/
custom_loss.py``) maps the same names to its own table of torch callables and checks again.

Pure standard library.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Literal, Protocol

from domain.tinker.errors import InvalidTrainingRequest, UnsupportedFeatureError
from domain.tinker.values import Datum, TensorValue

CUSTOM = "custom"  # the loss_fn of a forward_backward that runs a stored custom loss
LOSS_ID_KEY = "loss_id"  # its one loss_fn_config entry (a text value)

# --- limits -------------------------------------------------------------------------------

MAX_INPUTS = 16  # placeholders, logprobs included (the SDK's limit)
MAX_NODES = 1024  # nodes of one graph, placeholders and output included
MAX_BODY_BYTES = 1 << 20  # one create_custom_loss request body
MAX_ARG_DEPTH = 8  # nesting of lists, tuples, dicts and slices in one argument
MAX_STRING = 256  # characters of a string constant
MAX_METRICS = 64
MAX_LOSSES_PER_KEY = 64  # custom losses one API key holds at once (a session's go with it)
# At run time, per datum: elements of one intermediate value, and of all of them together.
MAX_VALUE_ELEMENTS = 1 << 24
MAX_DATUM_ELEMENTS = 1 << 26
MAX_INT = 2**63 - 1  # the magnitude of any integer, constant or computed
# Operations one forward_backward runs (the graph's calls times the data): the loss runs
# datum by datum, so this bounds the trainer's time a request takes.
MAX_CALLS_PER_REQUEST = 1 << 18

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_DEVICE = re.compile(r"[a-z]{1,16}(:[0-9]{1,4})?")

# --- the allow-lists (wire names, as the SDK writes them) -----------------------------------

GETATTR = "getattr"  # builtins.getattr: fx's record of ``x.shape`` and the like
# Functions that make a tensor: the server puts it on the loss's device (any ``device``
# argument is replaced).
FACTORIES: frozenset[str] = frozenset(
    f"torch.{name}"
    for name in ("tensor", "arange", "zeros", "ones", "full", "zeros_like", "ones_like")
) | {"torch.full_like"}
_TORCH = (
    # elementwise
    "abs neg sign exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square pow reciprocal "
    "sigmoid tanh relu erf floor ceil round trunc clamp clip clamp_min clamp_max minimum "
    "maximum where lerp logaddexp xlogy nan_to_num isfinite isnan isinf logical_and "
    "logical_or logical_not logical_xor eq ne lt le gt ge add sub mul div softmax "
    "log_softmax "
    # reductions and scans
    "sum mean nansum nanmean prod std var max min amax amin argmax argmin logsumexp all any "
    "count_nonzero cumsum dot "
    # shapes and indexing
    "cat concat stack squeeze unsqueeze reshape flatten transpose narrow gather "
    "take_along_dim index_select masked_select flip diff sort topk"
)
_FUNCTIONAL = (
    "log_softmax softmax sigmoid tanh mse_loss l1_loss smooth_l1_loss huber_loss kl_div "
    "binary_cross_entropy_with_logits"
)
_OPERATOR = (
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor invert getitem"
)
_MATH = "sqrt log log1p exp expm1 fabs floor ceil tanh isfinite isnan isinf"
FUNCTIONS: frozenset[str] = frozenset(
    [
        GETATTR,
        *FACTORIES,
        *(f"torch.{name}" for name in _TORCH.split()),
        *(f"torch.nn.functional.{name}" for name in _FUNCTIONAL.split()),
        # F.logsigmoid, F.softplus and F.gelu are torch's C functions
        "torch._C._nn.log_sigmoid",
        "torch._C._nn.softplus",
        "torch._C._nn.gelu",
        *(f"operator.{name}" for name in _OPERATOR.split()),
        *(f"math.{name}" for name in _MATH.split()),
    ]
)
# Operators on numbers and tensors only (a str or tuple operand is refused at run time).
ARITHMETIC: frozenset[str] = frozenset(
    f"operator.{name}" for name in _OPERATOR.split() if name != "getitem"
) | {f"math.{name}" for name in _MATH.split()}
# Tensor methods (no in-place ones, nothing that leaves torch or moves devices).
_METHODS = (
    "abs neg sign exp exp2 expm1 log log1p log2 sqrt rsqrt square pow reciprocal sigmoid "
    "tanh relu erf floor ceil round trunc clamp clip clamp_min clamp_max minimum maximum "
    "where lerp nan_to_num isfinite isnan isinf logical_and logical_or logical_not eq ne "
    "lt le gt ge add sub mul div softmax log_softmax logsumexp sum mean nansum prod std "
    "var max min amax amin argmax argmin all any count_nonzero cumsum dot float double "
    "half bfloat16 long int bool to type_as detach clone contiguous view view_as reshape "
    "reshape_as flatten squeeze unsqueeze transpose t permute expand expand_as repeat "
    "size dim numel gather index_select masked_fill masked_select flip narrow diff sort "
    "topk new_zeros new_ones new_full new_tensor"
)
METHODS: frozenset[str] = frozenset(_METHODS.split())
ATTRIBUTES: frozenset[str] = frozenset({"shape", "ndim", "dtype", "device", "T", "mT"})
_DTYPES = "float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool"
DTYPES: frozenset[str] = frozenset(_DTYPES.split())
LAYOUTS: frozenset[str] = frozenset({"strided"})
MEMORY_FORMATS: frozenset[str] = frozenset({"contiguous_format", "preserve_format"})
# Operations whose result size depends on the values (checked once computed).
DATA_DEPENDENT: frozenset[str] = frozenset(
    {"operator.getitem", "torch.masked_select", "masked_select"}
)


# --- the parsed graph ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ref:
    """The value of an earlier node."""

    name: str


@dataclass(frozen=True, slots=True)
class Constant:
    """A torch constant by name: a dtype, device, layout or memory format. A device is
    only a place holder: the loss runs on the server's device."""

    kind: Literal["dtype", "device", "layout", "memory_format"]
    value: str


@dataclass(frozen=True, slots=True)
class SliceArg:
    start: "Arg"
    stop: "Arg"
    step: "Arg"


@dataclass(frozen=True, slots=True)
class ListArg:
    """A list (a tuple is a Python tuple of arguments)."""

    items: tuple["Arg", ...]


@dataclass(frozen=True, slots=True)
class DictArg:
    items: tuple[tuple[str, "Arg"], ...]


Arg = (
    None
    | bool
    | int
    | float
    | str
    | EllipsisType
    | Ref
    | Constant
    | SliceArg
    | ListArg
    | DictArg
    | tuple["Arg", ...]
)


@dataclass(frozen=True, slots=True)
class Call:
    """One node: a function (``call_function``, by wire name) or a method of its first
    argument (``call_method``), bound to ``name``."""

    op: Literal["call_function", "call_method"]
    name: str
    target: str
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]


@dataclass(frozen=True, slots=True)
class CustomLossInput:
    """``logprobs`` (rank 1: ``[T]``) or a ``loss_fn_inputs`` key, with its rank (0: a
    scalar, 1: ``[T]``, 2: ``[T, K]``)."""

    name: str
    rank: int


@dataclass(frozen=True, slots=True)
class CustomLoss:
    """A checked custom loss: inputs in order (``logprobs`` first), the calls in execution
    order, and which values the output returns as the loss and as each metric."""

    name: str
    inputs: tuple[CustomLossInput, ...]
    calls: tuple[Call, ...]
    loss: Ref
    metrics: tuple[tuple[str, Ref], ...]

    @property
    def datum_inputs(self) -> tuple[CustomLossInput, ...]:
        """The ``loss_fn_inputs`` the loss reads (every input after ``logprobs``)."""
        return self.inputs[1:]


@dataclass(frozen=True, slots=True)
class RawNode:
    """A node as the wire has it (``CustomLossNode``), arguments as decoded JSON."""

    op: str
    name: str
    target: str
    args: Sequence[object]
    kwargs: Mapping[str, object]


def parse_custom_loss(
    name: str,
    inputs: Sequence[tuple[str, int]],
    nodes: Sequence[RawNode],
    graph_format: int = 1,
) -> CustomLoss:
    """The checked loss of a ``create_custom_loss`` request (``inputs``: (name, rank)
    pairs). Anything not allowed raises ``InvalidTrainingRequest`` naming it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidTrainingRequest(
            f"create_custom_loss: name {str(name)[:64]!r} must be 1-128 letters, digits and "
            "underscores (a Python identifier)"
        )
    where = f"create_custom_loss {name!r}"
    if graph_format != 1:
        raise InvalidTrainingRequest(f"{where}: graph format {graph_format} (only 1 is known)")
    loss_inputs = _inputs(where, inputs)
    if len(nodes) > MAX_NODES:
        raise InvalidTrainingRequest(
            f"{where}: {len(nodes)} nodes, the most allowed is {MAX_NODES}"
        )
    placeholders = [n for n in nodes[: len(loss_inputs)] if n.op == "placeholder"]
    for i, (node, want) in enumerate(zip(placeholders, loss_inputs, strict=False)):
        if node.name != want.name or node.target != want.name or node.args or node.kwargs:
            raise InvalidTrainingRequest(
                f"{where}: placeholder {i} is {node.name!r}, expected input {want.name!r} "
                "(the inputs in order, logprobs first)"
            )
    if len(placeholders) != len(loss_inputs):
        raise InvalidTrainingRequest(
            f"{where}: the graph has {len(placeholders)} leading placeholders for "
            f"{len(loss_inputs)} declared inputs"
        )
    defined = {i.name for i in loss_inputs}
    calls: list[Call] = []
    output: tuple[Ref, tuple[tuple[str, Ref], ...]] | None = None
    for node in nodes[len(loss_inputs) :]:
        at = f"{where}: node {str(node.name)[:64]!r}"
        if output is not None:
            raise InvalidTrainingRequest(f"{at} comes after the output node")
        if not isinstance(node.name, str) or not _NAME.fullmatch(node.name):
            raise InvalidTrainingRequest(f"{at}: a node name is an identifier of 1-128 chars")
        if node.name in defined:
            raise InvalidTrainingRequest(f"{at}: the name is used twice")
        if node.op == "output":
            output = _output(at, node, defined)
            continue
        calls.append(_call(at, node, defined))
        defined.add(node.name)
    if output is None:
        raise InvalidTrainingRequest(f"{where}: the graph has no output node")
    return CustomLoss(name, loss_inputs, tuple(calls), output[0], output[1])


def _inputs(where: str, inputs: Sequence[tuple[str, int]]) -> tuple[CustomLossInput, ...]:
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise InvalidTrainingRequest(
            f"{where}: {len(inputs)} inputs; a custom loss takes 1 to {MAX_INPUTS}, logprobs first"
        )
    out: list[CustomLossInput] = []
    for i, (name, rank) in enumerate(inputs):
        if not isinstance(name, str) or not _INPUT_NAME.fullmatch(name):
            raise InvalidTrainingRequest(
                f"{where}: input {i} name {str(name)[:64]!r} must be a lowercase identifier"
            )
        if isinstance(rank, bool) or rank not in (0, 1, 2):
            raise InvalidTrainingRequest(f"{where}: input {name!r} has rank {rank!r} (0, 1 or 2)")
        if name in (x.name for x in out):
            raise InvalidTrainingRequest(f"{where}: input {name!r} is declared twice")
        out.append(CustomLossInput(name, rank))
    first = out[0]
    if first.name != "logprobs":
        raise InvalidTrainingRequest(
            f"{where}: the first input must be logprobs, not {first.name!r}"
        )
    if first.rank == 2:
        raise UnsupportedFeatureError(
            f"{where}: logprobs of rank 2 (several targets per position) are not supported "
            "here; declare logprobs with rank 1"
        )
    if first.rank != 1:
        raise InvalidTrainingRequest(f"{where}: logprobs has rank 1 ([T]), not {first.rank}")
    return tuple(out)


def _call(at: str, node: RawNode, defined: set[str]) -> Call:
    op, target = node.op, node.target
    if op == "get_attr":
        raise InvalidTrainingRequest(
            f"{at} reads {str(target)[:64]!r} (a captured tensor or attribute); a custom loss "
            "reads only logprobs and its loss_fn_inputs"
        )
    if op == "call_module":
        raise InvalidTrainingRequest(
            f"{at} calls module {str(target)[:64]!r}: modules are not allowed"
        )
    if op == "placeholder":
        raise InvalidTrainingRequest(f"{at}: a placeholder after the inputs")
    if op not in ("call_function", "call_method") or not isinstance(target, str):
        raise InvalidTrainingRequest(f"{at}: unknown node op {str(op)[:32]!r}")
    args = tuple(_arg(at, a, defined, 0) for a in node.args)
    kwargs = tuple((_kwarg_name(at, k), _arg(at, v, defined, 0)) for k, v in node.kwargs.items())
    if op == "call_function":
        if target not in FUNCTIONS:
            raise InvalidTrainingRequest(
                f"{at} calls {target[:96]!r}, which is not an allowed function "
                "(torch, torch.nn.functional, math and operator functions on the server's list)"
            )
        if target == GETATTR:
            if kwargs or len(args) != 2 or not isinstance(args[0], Ref):
                raise InvalidTrainingRequest(f"{at}: getattr takes a value and an attribute name")
            if args[1] not in ATTRIBUTES:
                raise InvalidTrainingRequest(
                    f"{at} reads attribute {str(args[1])[:64]!r}, which is not allowed "
                    f"(allowed: {', '.join(sorted(ATTRIBUTES))})"
                )
    else:
        if target not in METHODS:
            raise InvalidTrainingRequest(
                f"{at} calls method {target[:96]!r}, which is not an allowed tensor method"
            )
        if not args or not isinstance(args[0], Ref):
            raise InvalidTrainingRequest(f"{at}: method {target!r} needs the value it is called on")
    for key, value in kwargs:
        if key == "out" or (key == "inplace" and value is not False):
            raise InvalidTrainingRequest(
                f"{at}: {key}= is not allowed (nothing is written in place)"
            )
    kind: Literal["call_function", "call_method"] = (
        "call_function" if op == "call_function" else "call_method"
    )
    return Call(kind, node.name, target, args, kwargs)


def _kwarg_name(at: str, key: object) -> str:
    if not isinstance(key, str) or not _NAME.fullmatch(key):
        raise InvalidTrainingRequest(f"{at}: keyword {str(key)[:64]!r} is not an identifier")
    return key


def _arg(at: str, value: object, defined: set[str], depth: int) -> Arg:
    """One encoded argument as a typed :data:`Arg` (references checked against
    ``defined``, the nodes computed before this one)."""
    if depth > MAX_ARG_DEPTH:
        raise InvalidTrainingRequest(f"{at}: arguments nest deeper than {MAX_ARG_DEPTH}")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise InvalidTrainingRequest(f"{at}: integer constant out of the int64 range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidTrainingRequest(f"{at}: a non-finite number constant ({value})")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise InvalidTrainingRequest(f"{at}: a string constant over {MAX_STRING} characters")
        return value
    if isinstance(value, list):
        return ListArg(tuple(_arg(at, v, defined, depth + 1) for v in value))
    if not isinstance(value, dict) or len(value) != 1:
        raise InvalidTrainingRequest(f"{at}: an argument of unknown form ({type(value).__name__})")
    ((kind, inner),) = value.items()
    if kind == "ref":
        if not isinstance(inner, str) or inner not in defined:
            raise InvalidTrainingRequest(
                f"{at} refers to {str(inner)[:64]!r}, which is not a node computed before it"
            )
        return Ref(inner)
    if kind in ("tuple", "slice"):
        if not isinstance(inner, list) or (kind == "slice" and len(inner) != 3):
            raise InvalidTrainingRequest(f"{at}: a malformed {kind}")
        items = tuple(_arg(at, v, defined, depth + 1) for v in inner)
        return SliceArg(*items) if kind == "slice" else items
    if kind == "dict":
        if not isinstance(inner, dict):
            raise InvalidTrainingRequest(f"{at}: a malformed dict")
        return DictArg(
            tuple((_kwarg_key(at, k), _arg(at, v, defined, depth + 1)) for k, v in inner.items())
        )
    if kind == "ellipsis" and inner is True:
        return ...
    if kind == "float":
        if inner in ("inf", "-inf"):
            return float(inner)
        raise InvalidTrainingRequest(
            f"{at}: float constant {str(inner)[:16]!r} (NaN is not allowed)"
        )
    if isinstance(inner, str):
        if kind == "dtype" and inner in DTYPES:
            return Constant("dtype", inner)
        if kind == "layout" and inner in LAYOUTS:
            return Constant("layout", inner)
        if kind == "memory_format" and inner in MEMORY_FORMATS:
            return Constant("memory_format", inner)
        if kind == "device" and _DEVICE.fullmatch(inner):
            return Constant("device", inner)
    raise InvalidTrainingRequest(
        f"{at}: unknown constant {{{str(kind)[:32]!r}: {str(inner)[:32]!r}}}"
    )


def _kwarg_key(at: str, key: object) -> str:
    if not isinstance(key, str) or len(key) > MAX_STRING:
        raise InvalidTrainingRequest(f"{at}: a dict key that is not a short string")
    return key


def _output(at: str, node: RawNode, defined: set[str]) -> tuple[Ref, tuple[tuple[str, Ref], ...]]:
    if len(node.args) != 1 or node.kwargs:
        raise InvalidTrainingRequest(f"{at}: the output node returns one value, (loss, metrics)")
    value = _arg(at, node.args[0], defined, 0)
    pair = value.items if isinstance(value, ListArg) else value
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise InvalidTrainingRequest(f"{at}: the loss must return (loss, metrics)")
    loss, metrics = pair
    if not isinstance(loss, Ref):
        raise InvalidTrainingRequest(f"{at}: the loss must be a computed tensor")
    if not isinstance(metrics, DictArg):
        raise InvalidTrainingRequest(f"{at}: the metrics must be a dict")
    if len(metrics.items) > MAX_METRICS:
        raise InvalidTrainingRequest(f"{at}: {len(metrics.items)} metrics (at most {MAX_METRICS})")
    out = []
    for key, metric in metrics.items:
        if not _METRIC_KEY.fullmatch(key):
            raise InvalidTrainingRequest(
                f"{at}: metric {key[:80]!r} must be named custom/<name>:sum or custom/<name>:mean"
            )
        if not isinstance(metric, Ref):
            raise InvalidTrainingRequest(f"{at}: metric {key!r} must be a computed tensor")
        out.append((key, metric))
    return loss, tuple(out)


# --- data ---------------------------------------------------------------------------------


def custom_loss_id(config: Mapping[str, float | str]) -> str:
    """The stored loss a ``custom`` forward_backward names (``{"loss_id": <text>}``)."""
    loss_id = config.get(LOSS_ID_KEY)
    extra = sorted(set(config) - {LOSS_ID_KEY})
    if not isinstance(loss_id, str) or extra:
        raise InvalidTrainingRequest(
            "loss_fn_config: loss_fn 'custom' takes exactly {'loss_id': <the id "
            "create_custom_loss returned>}" + (f" (unexpected: {extra[0]!r})" if extra else "")
        )
    return loss_id


def input_shape(value: TensorValue, rank: int) -> tuple[int, ...] | None:
    """``value``'s shape read at ``rank`` (None: it does not have that rank). The wire has
    no rank 0: a scalar arrives with one value and no shape, read here as ``[1]``."""
    if rank == 0:
        return () if len(value.data) == 1 and len(value.shape) <= 1 else None
    return value.shape if len(value.shape) == rank else None


def check_custom_data(data: Sequence[Datum], loss: CustomLoss) -> None:
    """Each datum has one int64 target per input token (``target_tokens``) and every input
    the loss reads at its declared rank; float inputs are finite; the loss's calls times
    the data are within ``MAX_CALLS_PER_REQUEST``."""
    runs = len(loss.calls) * len(data)
    if runs > MAX_CALLS_PER_REQUEST:
        raise InvalidTrainingRequest(
            f"loss {loss.name!r} runs {len(loss.calls)} operations on each of {len(data)} data: "
            f"at most {MAX_CALLS_PER_REQUEST} per request (send fewer data per request)"
        )
    for i, datum in enumerate(data):
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None or targets.shape != (len(datum.tokens),):
            raise InvalidTrainingRequest(
                f"data[{i}].loss_fn_inputs['target_tokens']: loss {loss.name!r} needs one "
                f"target per input token ([{len(datum.tokens)}])"
            )
        for spec in loss.datum_inputs:
            where = f"data[{i}].loss_fn_inputs[{spec.name!r}]"
            value = datum.loss_fn_inputs.get(spec.name)
            if value is None:
                raise InvalidTrainingRequest(f"{where}: missing (loss {loss.name!r} reads it)")
            if input_shape(value, spec.rank) is None:
                raise InvalidTrainingRequest(
                    f"{where}: shape {list(value.shape)}, but loss {loss.name!r} declared "
                    f"{spec.name} with rank {spec.rank}"
                )
            if value.dtype == "float32" and not all(map(math.isfinite, value.data)):
                raise InvalidTrainingRequest(f"{where}: values must be finite")


def reduce_metrics(sums: Mapping[str, float], count: int) -> dict[str, float]:
    """Per-datum metric sums over ``count`` data: ``:sum`` as summed, ``:mean`` averaged."""
    return {k: v / count if k.endswith(":mean") else v for k, v in sums.items()}


class CustomLossGradient(Protocol):
    """Runs a custom loss on one datum for a backend without autograd: ``(loss, d loss /
    d logprobs, metrics)`` at ``logprobs`` (the datum's target logprobs, ``[T]``);
    ``index`` names the datum in errors."""

    def __call__(
        self, loss: CustomLoss, logprobs: Sequence[float], datum: Datum, index: int
    ) -> tuple[float, list[float], dict[str, float]]: ...


def split_loss_config(
    loss_fn: str, config: Mapping[str, float | str]
) -> tuple[dict[str, float], str | None]:
    """(the numeric config, the loss id): ``custom`` takes its ``loss_id`` and nothing else,
    every other loss numbers only."""
    if loss_fn == CUSTOM:
        return {}, custom_loss_id(config)
    text = sorted(k for k, v in config.items() if isinstance(v, str))
    if text:
        raise InvalidTrainingRequest(
            f"loss_fn_config[{text[0]!r}]: text values are only for loss_fn 'custom' (its loss_id)"
        )
    return {k: float(v) for k, v in config.items()}, None
