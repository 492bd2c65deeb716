"""The idempotency store in Redis (``--redis-url``): replicas share stored replies."""

import base64
import json
from typing import Any

import redis.asyncio as redis

from domain.idempotency import Begin, StoredReply


class RedisIdempotencyStore:
    def __init__(self, url: str, *, prefix: str = "infer:idempotency:") -> None:
        self.client: Any = redis.from_url(url)
        self.prefix = prefix

    async def begin(self, key: str, fingerprint: str, ttl_s: float) -> Begin:
        name = self.prefix + key
        running = json.dumps({"fingerprint": fingerprint})
        if await self.client.set(name, running, nx=True, ex=max(1, int(ttl_s))):
            return "new"
        raw = await self.client.get(name)
        if raw is None:  # expired in between: take it
            return await self.begin(key, fingerprint, ttl_s)
        entry = json.loads(raw)
        if entry["fingerprint"] != fingerprint:
            return "conflict"
        if "status" not in entry:
            return "running"
        return StoredReply(
            entry["status"],
            tuple((str(k), str(v)) for k, v in entry["headers"]),
            base64.b64decode(entry["body"]),
        )

    async def finish(self, key: str, fingerprint: str, reply: StoredReply, ttl_s: float) -> None:
        entry = {
            "fingerprint": fingerprint,
            "status": reply.status,
            "headers": [list(h) for h in reply.headers],
            "body": base64.b64encode(reply.body).decode(),
        }
        await self.client.set(self.prefix + key, json.dumps(entry), ex=max(1, int(ttl_s)))

    async def abandon(self, key: str) -> None:
        await self.client.delete(self.prefix + key)
