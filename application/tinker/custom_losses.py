"""CustomLossStore: the custom losses sessions stored with ``create_custom_loss``.

A loss belongs to the API key (``owner``) and the session that created it: its id is
``<session>:loss:<custom_loss_seq_id>`` (so a fleet routes it with its session), only that
session's training runs may use it, and it goes when the session ends. A repeated
``custom_loss_seq_id`` with the same graph (an SDK retry) gets the same id; with another
graph it is a conflict. One key holds at most ``max_per_key`` losses at once.
"""

from dataclasses import dataclass

from domain.tinker.custom_loss import MAX_LOSSES_PER_KEY, CustomLoss
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError, SequenceConflictError


@dataclass(frozen=True, slots=True)
class CustomLossCreated:
    """What a ``create_custom_loss`` future resolves to."""

    loss_id: str


@dataclass(frozen=True, slots=True)
class _Stored:
    owner: str
    session_id: str
    loss: CustomLoss


class CustomLossStore:
    def __init__(self, max_per_key: int = MAX_LOSSES_PER_KEY) -> None:
        self.max_per_key = max_per_key
        self._losses: dict[str, _Stored] = {}

    def create(self, owner: str, session_id: str, seq_id: int, loss: CustomLoss) -> str:
        """Store ``loss`` for the session; its loss id."""
        if seq_id < 0:
            raise InvalidTrainingRequest("custom_loss_seq_id must be at least 0")
        loss_id = f"{session_id}:loss:{seq_id}"
        stored = self._losses.get(loss_id)
        if stored is not None:
            if stored.owner == owner and stored.loss == loss:
                return loss_id  # a retry
            raise SequenceConflictError(
                f"custom_loss_seq_id {seq_id} of session {session_id!r} was used for another "
                "loss; each create_custom_loss needs a new one"
            )
        held = sum(1 for s in self._losses.values() if s.owner == owner)
        if held >= self.max_per_key:
            raise InvalidTrainingRequest(
                f"this API key holds {held} custom losses, the most allowed "
                f"({self.max_per_key}): end a session that holds some"
            )
        self._losses[loss_id] = _Stored(owner, session_id, loss)
        return loss_id

    def get(self, owner: str, session_id: str, loss_id: str) -> CustomLoss:
        """The loss ``loss_id`` names, for a training run of ``session_id``."""
        stored = self._losses.get(loss_id)
        if stored is None or stored.owner != owner:
            raise NotFoundError(
                f"no custom loss {loss_id!r} (create it with create_custom_loss in this "
                "session; a session's losses end with it)"
            )
        if stored.session_id != session_id:
            raise InvalidTrainingRequest(
                f"custom loss {loss_id!r} belongs to session {stored.session_id!r}; only that "
                "session's training runs can use it"
            )
        return stored.loss

    def end_session(self, session_id: str) -> None:
        """Forget the session's losses."""
        for loss_id in [k for k, s in self._losses.items() if s.session_id == session_id]:
            del self._losses[loss_id]

    def __len__(self) -> int:
        return len(self._losses)
