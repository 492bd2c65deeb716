"""Rollouts: a model name whose requests are split between served models (builds) — a
canary by traffic share, by tenant, or both — and moved or rolled back at run time.

A :class:`Rollout` named ``support`` with targets ``lora-v1`` (weight 90) and ``lora-v2``
(weight 10, tenants ``beta``) sends every request of tenant ``beta`` to ``lora-v2`` and
the others 90 : 10. The pick is sticky: requests with the same key (the OpenAI ``user``
field when given) land on the same target while the weights stay; without one each
request draws anew.
"""

import hashlib
import random
from dataclasses import dataclass
from typing import Protocol

from domain.errors import InvalidParameterError

MAX_TARGETS = 16
# The rollback policy's defaults: a target failing 25 % of its last 100 requests (20 at
# least) is taken out.
DEFAULT_MAX_ERROR_RATE, DEFAULT_MIN_REQUESTS, DEFAULT_WINDOW = 0.25, 20, 100


@dataclass(frozen=True, slots=True)
class RolloutTarget:
    """``model``: a served model's name; ``weight``: its share of the requests not pinned
    to a target by tenant (0: none); ``tenants``: tenants whose requests all go here."""

    model: str
    weight: float = 0.0
    tenants: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RollbackPolicy:
    """When a target is rolled back by itself: once ``min_requests`` of its last
    ``window`` requests are in and at least ``max_error_rate`` of them failed (a 5xx, or
    an engine error mid-stream) while another target serving by weight fails less."""

    max_error_rate: float = DEFAULT_MAX_ERROR_RATE
    min_requests: int = DEFAULT_MIN_REQUESTS
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not 0 < self.max_error_rate <= 1:
            raise InvalidParameterError("max_error_rate", "must be in (0, 1]")
        if not 1 <= self.min_requests <= self.window <= 10_000:
            raise InvalidParameterError("min_requests", "need 1 <= min_requests <= window <= 10000")


@dataclass(frozen=True, slots=True)
class Rollout:
    """``rollback``: when a failing target is taken out by itself (None: never)."""

    name: str
    targets: tuple[RolloutTarget, ...]
    rollback: RollbackPolicy | None = RollbackPolicy()

    def __post_init__(self) -> None:
        where = f"rollout {self.name!r}"
        if not self.name or self.name != self.name.strip():
            raise InvalidParameterError("name", f"{self.name!r} is not a usable model name")
        if not 1 <= len(self.targets) <= MAX_TARGETS:
            raise InvalidParameterError("targets", f"{where}: give 1 to {MAX_TARGETS} targets")
        models = [t.model for t in self.targets]
        if len(set(models)) != len(models):
            raise InvalidParameterError("targets", f"{where}: a model is listed twice")
        if self.name in models:
            raise InvalidParameterError("targets", f"{where}: a rollout cannot target itself")
        pinned: set[str] = set()
        for target in self.targets:
            if not target.weight >= 0 or target.weight == float("inf"):
                raise InvalidParameterError(
                    "weight", f"{where}: {target.model!r}'s weight must be 0 or more"
                )
            if overlap := pinned & target.tenants:
                raise InvalidParameterError(
                    "tenants", f"{where}: tenant {sorted(overlap)[0]!r} is pinned twice"
                )
            pinned |= target.tenants
        if sum(t.weight for t in self.targets) <= 0:
            raise InvalidParameterError("weight", f"{where}: the weights must not all be 0")

    def pick(self, tenant: str | None = None, sticky: str | None = None) -> str:
        """The model a request goes to: its tenant's pinned target, else one drawn by
        weight (from ``sticky``'s hash when given: the same key, the same target)."""
        if tenant is not None:
            for target in self.targets:
                if tenant in target.tenants:
                    return target.model
        if sticky:
            digest = hashlib.sha256(f"{self.name}\0{sticky}".encode()).digest()
            draw = int.from_bytes(digest[:8], "big") / 2**64
        else:
            draw = random.random()
        total = sum(t.weight for t in self.targets)
        point, upto = draw * total, 0.0
        weighted = [t for t in self.targets if t.weight > 0]
        for target in weighted:
            upto += target.weight
            if point < upto:
                return target.model
        return weighted[-1].model  # rounding at the top end

    def without(self, model: str) -> "Rollout":
        """The rollout with ``model`` rolled back: no weight, no tenants pinned to it
        (``InvalidParameterError`` when nothing would be left to serve)."""
        targets = tuple(
            RolloutTarget(t.model, 0.0) if t.model == model else t for t in self.targets
        )
        return Rollout(self.name, targets, self.rollback)

    def shares(self) -> dict[str, float]:
        """Each target's share of the unpinned requests (0 to 1)."""
        total = sum(t.weight for t in self.targets)
        return {t.model: t.weight / total for t in self.targets}


def parse_rollout(text: str) -> Rollout:
    """``NAME=MODEL:WEIGHT[,MODEL:WEIGHT...]`` (``--model-rollout``'s form; a model's
    weight may be left out for 0, which serves only pinned tenants, of which the flag
    has none — the admin API pins tenants)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise InvalidParameterError(
            "model_rollout", f"{text!r}: expected NAME=MODEL:WEIGHT[,MODEL:WEIGHT...]"
        )
    targets = []
    for part in rest.split(","):
        model, _, weight = part.rpartition(":")
        if not model:
            model, weight = weight, "0"
        try:
            value = float(weight)
        except ValueError:
            raise InvalidParameterError(
                "model_rollout", f"{text!r}: {weight!r} is not a weight"
            ) from None
        targets.append(RolloutTarget(model.strip(), value))
    try:
        return Rollout(name.strip(), tuple(targets))
    except InvalidParameterError as e:
        raise InvalidParameterError("model_rollout", e.message) from e


class RolloutStore(Protocol):
    """Where rollouts are kept beyond one process's memory (the usage ledger's database):
    a restart keeps them, and the servers sharing the database serve the same ones."""

    def load(self) -> list[Rollout]:
        """Every stored rollout."""
        ...

    def save(self, rollout: Rollout) -> None:
        """Store ``rollout`` (replacing the one of its name)."""
        ...

    def delete(self, name: str) -> None: ...

    def version(self) -> int:
        """A number that changes whenever a rollout is saved or deleted."""
        ...
