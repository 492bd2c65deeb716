"""The Responses API's store as a port: a finished response kept per tenant, so that a later
request continues it (``previous_response_id``); implemented in this process
(:class:`application.serving.responses.MemoryResponseStore`) and in Redis
(``adapters/storage/responses.py``)."""

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """``response``: the response object as answered (JSON data); ``conversation``: the
    items it answered, in order (JSON data). Treated as immutable."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore(Protocol):
    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored`` under ``tenant``'s ``response_id`` (replacing any)."""
        ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The response ``tenant`` stored as ``response_id`` (None: unknown, expired,
        deleted, or another tenant's)."""
        ...

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget it; False when there was nothing to forget."""
        ...
