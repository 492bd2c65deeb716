"""Stored custom losses (:mod:`domain.tinker.custom_loss`) run on torch tensors, node by node.

Nothing of the upload is executed as Python: every function comes from this module's own
table (``FUNCTION_TABLE``: the callables themselves, keyed by the wire name the SDK gives
them), every method from ``METHOD_TABLE`` and every attribute from ``_ATTRIBUTES``; a
name not there is refused (HTTP 400) even if the domain's lists let it through. Devices
are the server's: a device argument is replaced by the loss's device, and ``to()`` only
changes dtypes.

Before each operation runs, it runs on ``meta`` tensors (shapes only, nothing allocated)
so a result past ``MAX_VALUE_ELEMENTS``, or a datum's values past ``MAX_DATUM_ELEMENTS``,
is refused before it is made; operations whose size depends on values (boolean masks) are
checked once computed, their results no bigger than their inputs. Python arithmetic takes
numbers and tensors only, integers within int64.

:func:`run_custom_loss` runs one datum (loss tensor and metrics); :func:`custom_loss_sum`
a LoRA micro-batch (with a check that the gradient reaching the logprobs is finite, before
any reaches the adapter); :func:`custom_loss_gradient` is the ``CustomLossGradient`` port
for the numpy ToyBackend.
"""

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from domain.tinker.custom_loss import (
    ARITHMETIC,
    DATA_DEPENDENT,
    FACTORIES,
    GETATTR,
    MAX_DATUM_ELEMENTS,
    MAX_INT,
    MAX_VALUE_ELEMENTS,
    Arg,
    Call,
    Constant,
    CustomLoss,
    DictArg,
    ListArg,
    Ref,
    SliceArg,
    input_shape,
)
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import Datum

_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    # factories (their device is set here)
    torch.tensor,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    # elementwise
    *(
        torch.abs,
        torch.neg,
        torch.sign,
        torch.exp,
        torch.exp2,
        torch.expm1,
        torch.log,
        torch.log1p,
        torch.log2,
        torch.log10,
        torch.sqrt,
        torch.rsqrt,
        torch.square,
        torch.pow,
        torch.reciprocal,
        torch.sigmoid,
        torch.tanh,
        torch.relu,
        torch.erf,
        torch.floor,
        torch.ceil,
        torch.round,
        torch.trunc,
        torch.clamp,
        torch.clip,
        torch.clamp_min,
        torch.clamp_max,
        torch.minimum,
        torch.maximum,
        torch.where,
        torch.lerp,
        torch.logaddexp,
        torch.xlogy,
        torch.nan_to_num,
        torch.isfinite,
        torch.isnan,
        torch.isinf,
        torch.logical_and,
        torch.logical_or,
        torch.logical_not,
        torch.logical_xor,
        torch.eq,
        torch.ne,
        torch.lt,
        torch.le,
        torch.gt,
        torch.ge,
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.softmax,
        torch.log_softmax,
    ),
    # reductions and scans
    *(
        torch.sum,
        torch.mean,
        torch.nansum,
        torch.nanmean,
        torch.prod,
        torch.std,
        torch.var,
        torch.max,
        torch.min,
        torch.amax,
        torch.amin,
        torch.argmax,
        torch.argmin,
        torch.logsumexp,
        torch.all,
        torch.any,
        torch.count_nonzero,
        torch.cumsum,
        torch.dot,
    ),
    # shapes and indexing
    *(
        torch.cat,
        torch.concat,
        torch.stack,
        torch.squeeze,
        torch.unsqueeze,
        torch.reshape,
        torch.flatten,
        torch.transpose,
        torch.narrow,
        torch.gather,
        torch.take_along_dim,
        torch.index_select,
        torch.masked_select,
        torch.flip,
        torch.diff,
        torch.sort,
        torch.topk,
    ),
    # torch.nn.functional
    *(
        F.log_softmax,
        F.softmax,
        F.sigmoid,
        F.tanh,
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.kl_div,
        F.binary_cross_entropy_with_logits,
        F.logsigmoid,
        F.softplus,
        F.gelu,
    ),
    # Python's operators and math, on numbers and tensors
    *(
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.floordiv,
        operator.mod,
        operator.pow,
        operator.neg,
        operator.pos,
        operator.abs,
        operator.eq,
        operator.ne,
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
        operator.and_,
        operator.or_,
        operator.xor,
        operator.invert,
        operator.getitem,
    ),
    *(
        math.sqrt,
        math.log,
        math.log1p,
        math.exp,
        math.expm1,
        math.fabs,
        math.floor,
        math.ceil,
        math.tanh,
        math.isfinite,
        math.isnan,
        math.isinf,
    ),
)
_METHODS: tuple[Callable[..., Any], ...] = (
    *(Tensor.abs, Tensor.neg, Tensor.sign, Tensor.exp, Tensor.exp2, Tensor.expm1, Tensor.log),
    *(Tensor.log1p, Tensor.log2, Tensor.sqrt, Tensor.rsqrt, Tensor.square, Tensor.pow),
    *(Tensor.reciprocal, Tensor.sigmoid, Tensor.tanh, Tensor.relu, Tensor.erf, Tensor.floor),
    *(Tensor.ceil, Tensor.round, Tensor.trunc, Tensor.clamp, Tensor.clip, Tensor.clamp_min),
    *(Tensor.clamp_max, Tensor.minimum, Tensor.maximum, Tensor.where, Tensor.lerp),
    *(Tensor.nan_to_num, Tensor.isfinite, Tensor.isnan, Tensor.isinf, Tensor.logical_and),
    *(Tensor.logical_or, Tensor.logical_not, Tensor.eq, Tensor.ne, Tensor.lt, Tensor.le),
    *(Tensor.gt, Tensor.ge, Tensor.add, Tensor.sub, Tensor.mul, Tensor.div, Tensor.softmax),
    *(Tensor.log_softmax, Tensor.logsumexp, Tensor.sum, Tensor.mean, Tensor.nansum),
    *(Tensor.prod, Tensor.std, Tensor.var, Tensor.max, Tensor.min, Tensor.amax, Tensor.amin),
    *(Tensor.argmax, Tensor.argmin, Tensor.all, Tensor.any, Tensor.count_nonzero),
    *(Tensor.cumsum, Tensor.dot, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16),
    *(Tensor.long, Tensor.int, Tensor.bool, Tensor.type_as, Tensor.detach, Tensor.clone),
    *(Tensor.contiguous, Tensor.view, Tensor.view_as, Tensor.reshape, Tensor.reshape_as),
    *(Tensor.flatten, Tensor.squeeze, Tensor.unsqueeze, Tensor.transpose, Tensor.t),
    *(Tensor.permute, Tensor.expand, Tensor.expand_as, Tensor.repeat, Tensor.size),
    *(Tensor.dim, Tensor.numel, Tensor.gather, Tensor.index_select, Tensor.masked_fill),
    *(Tensor.masked_select, Tensor.flip, Tensor.narrow, Tensor.diff, Tensor.sort),
    *(Tensor.topk, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_tensor),
)


def wire_name(fn: Callable[..., Any]) -> str:
    """The name the SDK sends for ``fn`` (torch.fx's qualified name; Python's operators
    under ``operator``, not CPython's ``_operator``)."""
    from torch.fx.node import _get_qualified_name

    name = _get_qualified_name(fn)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


def _to(self: Tensor, *args: object, **kwargs: object) -> Tensor:
    """``Tensor.to`` for dtypes only: a device (the loss's own) is ignored, a name refused."""
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("device", None)
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, Tensor):
            dtype = arg.dtype
        elif not isinstance(arg, torch.device):
            raise ValueError(f"to() takes a dtype or a tensor, not {arg!r:.40}")
    unknown = set(kwargs) - {"non_blocking", "copy", "memory_format"}
    if unknown or not isinstance(dtype, torch.dtype | None):
        raise ValueError(f"to(): unexpected arguments {sorted(unknown) or [dtype]}")
    return self.to(dtype or self.dtype, **kwargs)  # type: ignore[call-overload]


FUNCTION_TABLE: Mapping[str, Callable[..., Any]] = {wire_name(f): f for f in _FUNCTIONS}
METHOD_TABLE: Mapping[str, Callable[..., Any]] = {
    **{f.__name__: f for f in _METHODS},
    "to": _to,
}
_ATTRIBUTES: Mapping[str, Callable[[Tensor], object]] = {
    "shape": lambda t: t.shape,
    "ndim": lambda t: t.ndim,
    "dtype": lambda t: t.dtype,
    "device": lambda t: t.device,
    "T": lambda t: t.T,
    "mT": lambda t: t.mT,
}
_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_MEMORY_FORMATS: Mapping[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
}
_META = torch.device("meta")
_NUMBER = (bool, int, float)


def datum_inputs(loss: CustomLoss, datum: Datum, device: torch.device) -> list[Tensor]:
    """The datum's ``loss_fn_inputs`` the loss reads, in order, as tensors of their declared
    rank (checked by ``check_custom_data``)."""
    out = []
    for spec in loss.datum_inputs:
        value = datum.loss_fn_inputs[spec.name]
        shape = input_shape(value, spec.rank)
        assert shape is not None, spec  # check_custom_data ran
        dtype = torch.int64 if value.dtype == "int64" else torch.float32
        out.append(torch.tensor(value.data.tolist(), dtype=dtype).reshape(shape).to(device))
    return out


def run_custom_loss(
    loss: CustomLoss, logprobs: Tensor, inputs: Sequence[Tensor], *, where: str = "datum"
) -> tuple[Tensor, dict[str, float]]:
    """One datum's loss (a 0-d tensor, differentiable in ``logprobs``) and its metrics."""
    return _Interpreter(loss, logprobs.device, where).run([logprobs, *inputs])


def custom_loss_sum(
    loss: CustomLoss, logp: Tensor, data: Sequence[Datum], indices: Sequence[int]
) -> tuple[Tensor, dict[str, float]]:
    """The summed loss of the data at ``indices`` (``logp``: their target logprobs, one
    after the other) and their metrics summed per key; when ``logp`` takes a gradient, a
    non-finite one stops the backward pass (``InvalidTrainingRequest``) before the
    adapter's weights get any of it."""
    pieces = logp.split([len(data[i].tokens) for i in indices])
    total = logp.new_zeros(())
    sums: dict[str, float] = {}
    for i, piece in zip(indices, pieces, strict=True):
        inputs = datum_inputs(loss, data[i], logp.device)
        value, metrics = run_custom_loss(loss, piece, inputs, where=f"data[{i}]")
        total = total + value.to(total.dtype)
        for key, metric in metrics.items():
            sums[key] = sums.get(key, 0.0) + metric
    if logp.requires_grad:
        logp.register_hook(_finite_gradient(loss.name))
    return total, sums


def custom_loss_gradient(
    loss: CustomLoss, logprobs: Sequence[float], datum: Datum, index: int
) -> tuple[float, list[float], dict[str, float]]:
    """The ``CustomLossGradient`` port on the CPU: one datum's loss, its gradient with
    respect to ``logprobs`` (zero where the loss does not depend on them) and metrics."""
    logp = torch.tensor(list(logprobs), dtype=torch.float32, requires_grad=True)
    inputs = datum_inputs(loss, datum, logp.device)
    value, metrics = run_custom_loss(loss, logp, inputs, where=f"data[{index}]")
    grad = torch.zeros_like(logp)
    if value.requires_grad:
        (found,) = torch.autograd.grad(value, logp, allow_unused=True)
        grad = grad if found is None else found
    _finite_gradient(loss.name)(grad)
    return float(value.detach()), grad.tolist(), metrics


def _finite_gradient(name: str) -> Callable[[Tensor], None]:
    def check(grad: Tensor) -> None:
        if not bool(torch.isfinite(grad).all()):
            raise InvalidTrainingRequest(
                f"custom loss {name!r}: its gradient with respect to logprobs is not finite "
                "(nothing was applied)"
            )

    return check


class _Interpreter:
    def __init__(self, loss: CustomLoss, device: torch.device, where: str) -> None:
        self.loss, self.device, self.where = loss, device, where
        self.elements = 0

    def fail(self, call: Call | None, message: str) -> InvalidTrainingRequest:
        node = "" if call is None else f" node {call.name!r} ({call.target})"
        return InvalidTrainingRequest(
            f"custom loss {self.loss.name!r} on {self.where}:{node} {message}"
        )

    def run(self, inputs: Sequence[Tensor]) -> tuple[Tensor, dict[str, float]]:
        env: dict[str, object] = {}
        for spec, value in zip(self.loss.inputs, inputs, strict=True):
            env[spec.name] = value
        for call in self.loss.calls:
            env[call.name] = self.call(call, env)
        loss = self.lookup(env, self.loss.loss.name)
        if not isinstance(loss, Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            raise self.fail(None, "must return its loss as a 0-d floating-point tensor")
        if not bool(torch.isfinite(loss.detach())):
            raise self.fail(None, f"returned a non-finite loss ({float(loss)})")
        metrics = {}
        for key, ref in self.loss.metrics:
            metric = self.lookup(env, ref.name)
            if isinstance(metric, Tensor) and metric.numel() == 1:
                metrics[key] = float(metric.detach().reshape(()))
            elif isinstance(metric, _NUMBER):
                metrics[key] = float(metric)
            else:
                raise self.fail(None, f"metric {key!r} must be a one-element tensor")
        return loss, metrics

    def call(self, call: Call, env: Mapping[str, object]) -> object:
        fn = self.resolve(call)
        args = [self.value(a, env) for a in call.args]
        kwargs = {key: self.value(a, env) for key, a in call.kwargs}
        if "device" in kwargs or call.target in FACTORIES:
            kwargs["device"] = self.device
        self.guard(call, args)
        try:
            self.dry_run(call, fn, args, kwargs)
            out = fn(*args, **kwargs)
        except (InvalidTrainingRequest, torch.OutOfMemoryError):
            raise
        except Exception as e:  # the graph's own error (shapes, dtypes, arguments)
            message = str(e).strip().splitlines()[0][:240] if str(e).strip() else ""
            raise self.fail(call, f"failed: {type(e).__name__}: {message}") from None
        self.account(call, out)
        return out

    def resolve(self, call: Call) -> Callable[..., Any]:
        """The callable of ``call``, from this module's tables only."""
        if call.op == "call_method":
            fn = METHOD_TABLE.get(call.target)
        elif call.target == GETATTR:
            fn = self.attribute
        else:
            fn = FUNCTION_TABLE.get(call.target)
        if fn is None:
            raise self.fail(call, "is not an operation this server runs")
        return fn

    def attribute(self, value: object, name: object) -> object:
        read = _ATTRIBUTES.get(name) if isinstance(name, str) else None
        if not isinstance(value, Tensor) or read is None:
            raise ValueError(f"getattr({type(value).__name__}, {name!r:.40}) is not allowed")
        return read(value)

    def lookup(self, env: Mapping[str, object], name: str) -> object:
        if name not in env:  # parse_custom_loss orders the graph; checked again here
            raise self.fail(None, f"refers to {name!r} before it is computed")
        return env[name]

    def value(self, arg: Arg, env: Mapping[str, object]) -> object:
        if isinstance(arg, Ref):
            return self.lookup(env, arg.name)
        if isinstance(arg, tuple):
            return tuple(self.value(a, env) for a in arg)
        if isinstance(arg, ListArg):
            return [self.value(a, env) for a in arg.items]
        if isinstance(arg, DictArg):
            return {key: self.value(a, env) for key, a in arg.items}
        if isinstance(arg, SliceArg):
            return slice(*(self.value(a, env) for a in (arg.start, arg.stop, arg.step)))
        if isinstance(arg, Constant):
            if arg.kind == "dtype":
                return _DTYPES[arg.value]
            if arg.kind == "device":
                return self.device
            if arg.kind == "layout":
                return torch.strided
            return _MEMORY_FORMATS[arg.value]
        return arg  # None, a number, a string or Ellipsis

    def guard(self, call: Call, args: Sequence[object]) -> None:
        """What the operation may take: methods need a tensor, Python's operators numbers
        or tensors (no strings or sequences), integer powers a small exponent."""
        if call.op == "call_method" and not isinstance(args[0], Tensor):
            raise self.fail(call, f"called on a {type(args[0]).__name__}, not a tensor")
        if call.target in ARITHMETIC:
            for a in args:
                if not isinstance(a, (Tensor, *_NUMBER)):
                    raise self.fail(call, f"takes numbers or tensors, not a {type(a).__name__}")
            if call.target == "operator.pow" and all(isinstance(a, int) for a in args):
                base, exponent = args
                if abs(base) > 1 and abs(exponent) > 64:  # type: ignore[arg-type]
                    raise self.fail(call, "an integer power out of the int64 range")

    def dry_run(
        self, call: Call, fn: Callable[..., Any], args: list[object], kwargs: dict[str, object]
    ) -> None:
        """``call`` on meta tensors: refused if its result would be too big (or if it
        cannot run at all); value-dependent operations are checked once computed."""
        if call.target not in FACTORIES and not _tensors([*args, *kwargs.values()]):
            return  # Python numbers only
        errors = []
        for keep_scalars in (False, True):
            try:
                with torch.no_grad():
                    out = fn(
                        *_to_meta(args, keep_scalars),
                        **{k: _to_meta(v, keep_scalars) for k, v in kwargs.items()},
                    )
            except (InvalidTrainingRequest, torch.OutOfMemoryError):
                raise
            except Exception as e:
                errors.append(e)
                continue
            self.check_size(call, _elements(out))
            return
        if call.target in DATA_DEPENDENT:
            return  # at most its input's size: checked once computed
        raise errors[-1]

    def check_size(self, call: Call, elements: int) -> None:
        if elements > MAX_VALUE_ELEMENTS:
            raise self.fail(
                call,
                f"makes {elements} elements, the most one value may hold is {MAX_VALUE_ELEMENTS}",
            )
        if self.elements + elements > MAX_DATUM_ELEMENTS:
            raise self.fail(
                call, f"brings the loss's values past {MAX_DATUM_ELEMENTS} elements per datum"
            )

    def account(self, call: Call, out: object) -> None:
        if isinstance(out, int) and not isinstance(out, bool) and abs(out) > MAX_INT:
            raise self.fail(call, "an integer out of the int64 range")
        elements = _elements(out)
        self.check_size(call, elements)
        self.elements += elements


def _tensors(values: Sequence[object]) -> list[Tensor]:
    found: list[Tensor] = []
    for v in values:
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, list | tuple):
            found.extend(_tensors(v))
        elif isinstance(v, dict):
            found.extend(_tensors(list(v.values())))
    return found


def _to_meta(value: Any, keep_scalars: bool) -> Any:
    """``value`` with its tensors on the meta device (0-d ones as CPU values when
    ``keep_scalars``: some operations read a scalar's value) and devices set to meta."""
    if isinstance(value, Tensor):
        if keep_scalars and value.ndim == 0:
            return value.detach().cpu()
        return value.detach().to(_META)
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, list):
        return [_to_meta(v, keep_scalars) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_to_meta(v, keep_scalars) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v, keep_scalars) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_to_meta(v, keep_scalars) for v in (value.start, value.stop, value.step)))
    return value


def _elements(value: object) -> int:
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return sum(_elements(v) for v in value)
    return 0
