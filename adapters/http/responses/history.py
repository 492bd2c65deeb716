"""The stored responses as the face uses them: per caller's tenant, unknown ids as
OpenAI's 404s, storing a finished response with the conversation it answered."""

from typing import Any

import msgspec
import structlog
from litestar import Request

from adapters.http.errors import HTTPError
from adapters.http.request_state import api_state
from adapters.http.responses.schemas import ResponseObject
from application.serving.responses import OPEN_TENANT
from domain.responses import ResponseStore, StoredResponse

log = structlog.get_logger(__name__)


def tenant_of(request: Request[Any, Any, Any]) -> str:
    """The caller's tenant (an open server's callers share one)."""
    tenant = api_state(request).tenant
    return OPEN_TENANT if tenant is None else tenant.id


class ResponseHistory:
    """Responses kept in ``store`` (None: none are kept, ``store`` is read as false)."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    def stores(self, asked: bool | None) -> bool:
        """Whether a response is kept: ``store`` defaults to true, as on OpenAI."""
        return self.store is not None and asked is not False

    async def previous(self, tenant: str, response_id: str | None) -> StoredResponse | None:
        """The response a request continues (None: none named); an unknown id is a 404."""
        if response_id is None:
            return None
        found = None if self.store is None else await self.store.get(tenant, response_id)
        if found is None:
            raise HTTPError(
                404,
                f"Previous response with id '{response_id}' not found.",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        return found

    async def find(self, tenant: str, response_id: str) -> StoredResponse:
        found = None if self.store is None else await self.store.get(tenant, response_id)
        if found is None:
            raise not_found(response_id)
        return found

    async def delete(self, tenant: str, response_id: str) -> None:
        if self.store is None or not await self.store.delete(tenant, response_id):
            raise not_found(response_id)

    async def keep(
        self, tenant: str, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> None:
        """Store a finished response (its ``store`` says whether to)."""
        if self.store is None or not response.store:
            return
        stored = StoredResponse(msgspec.to_builtins(response), conversation)
        try:
            await self.store.put(tenant, response.id, stored)
        except Exception as e:
            log.exception("storing a response failed", response_id=response.id)
            raise HTTPError(500, f"the response could not be stored: {e}", "server_error") from e


def not_found(response_id: str) -> HTTPError:
    return HTTPError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", None
    )
