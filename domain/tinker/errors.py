"""The fine-tuning half's errors: each maps to one HTTP status in the Tinker face."""

from typing import Literal

from domain.errors import InferError


class TrainingError(InferError):
    """Base of the fine-tuning API's errors; ``category`` is Tinker's error category."""

    category: Literal["user", "server"] = "user"


class NotFoundError(TrainingError):
    """No such session, run, sampler, checkpoint or future (for this API key)."""


class InvalidTrainingRequest(TrainingError, ValueError):
    """A request is malformed or inconsistent (bad shapes, unknown loss, bad path...)."""


class UnsupportedFeatureError(TrainingError):
    """A feature the SDK can ask for that this server does not have."""


class SequenceConflictError(TrainingError):
    """A training request's ``seq_id`` was already used for its run."""


class SessionClosedError(TrainingError):
    """The session finished or expired; its pending work was cancelled."""


class RetryLaterError(TrainingError):
    """A per-run queue is full for now (HTTP 429, which the SDK retries): the request is
    fine and is accepted once earlier requests of the run have run."""


class BackendFailure(TrainingError):
    """The training backend failed on valid input (a server-side error)."""

    category = "server"


def error_payload(message: str, category: str) -> dict[str, str]:
    """What a Tinker API error answers: the message (as ``detail`` and ``error``) and its
    category (``user``: the caller's to fix; ``server``: ours), which the SDK reads."""
    return {"detail": message, "error": message, "category": category}
