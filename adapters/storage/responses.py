"""Stored responses in Redis (``--redis-url``): replicas share them, each key expiring
``ttl_s`` after it was stored (Redis's own memory policy bounds how many)."""

import json
from typing import Any

import redis.asyncio as redis

from domain.responses import StoredResponse


class RedisResponseStore:
    def __init__(self, url: str, ttl_s: float, *, prefix: str = "infer:responses:") -> None:
        self.client: Any = redis.from_url(url)
        self.ttl_s, self.prefix = ttl_s, prefix

    def _key(self, tenant: str, response_id: str) -> str:
        # The tenant's length first: no two (tenant, id) pairs share a key.
        return f"{self.prefix}{len(tenant)}:{tenant}:{response_id}"

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        entry = {"response": stored.response, "conversation": stored.conversation}
        await self.client.set(
            self._key(tenant, response_id), json.dumps(entry), ex=max(1, int(self.ttl_s))
        )

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self._key(tenant, response_id))
        if raw is None:
            return None
        entry = json.loads(raw)
        return StoredResponse(entry["response"], entry["conversation"])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self.client.delete(self._key(tenant, response_id)))
