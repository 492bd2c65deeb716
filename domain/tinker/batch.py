"""One forward/backward call: its batch (the data, the loss, a stored custom loss) and its
result."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from domain.tinker.custom_loss import CustomLoss
from domain.tinker.values import Datum, TensorValue


@dataclass(frozen=True, slots=True)
class ForwardBackwardInput:
    """One forward/backward call's batch (Tinker's ``ForwardBackwardInput``): the data and
    the loss over it, ``loss_fn_config`` as given (:func:`loss_config` fills defaults);
    ``custom_loss``: for loss_fn ``custom``, the stored loss its ``loss_id`` names."""

    data: Sequence[Datum]
    loss_fn: str
    loss_fn_config: Mapping[str, float] = field(default_factory=dict)
    custom_loss: CustomLoss | None = None


@dataclass(frozen=True, slots=True)
class ForwardBackwardResult:
    """Per-datum outputs (``logprobs`` of the target tokens at least) and ``name:reduction``
    metrics (``loss:sum``)."""

    outputs: list[dict[str, TensorValue]]
    metrics: dict[str, float]
