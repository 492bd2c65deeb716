"""The in-memory store of /v1/responses: per tenant, bounded in count (oldest first), each
entry expiring after its lifetime; the serve flags that size it or turn it off."""

import asyncio
from typing import Any

import pytest

from application.serving.responses import MemoryResponseStore
from domain.errors import InvalidParameterError
from domain.responses import StoredResponse


def stored(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "output": []}, [{"type": "message", "n": n}])


def test_entries_are_per_tenant_bounded_and_expire() -> None:
    now = [0.0]
    store = MemoryResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])

    async def run() -> None:
        await store.put("alice", "resp_1", stored(1))
        assert await store.get("alice", "resp_1") == stored(1)
        assert await store.get("bob", "resp_1") is None
        assert not await store.delete("bob", "resp_1")
        now[0] = 5.0
        await store.put("alice", "resp_2", stored(2))
        await store.put("bob", "resp_3", stored(3))  # over the bound: the oldest goes
        assert len(store) == 2 and await store.get("alice", "resp_1") is None
        now[0] = 15.0  # resp_2 and resp_3 were stored at 5: alive until 15
        await store.put("alice", "resp_4", stored(4))
        assert len(store) == 1  # the expired ones went when it was stored
        assert await store.get("alice", "resp_2") is None
        assert await store.get("alice", "resp_4") == stored(4)
        assert await store.delete("alice", "resp_4")
        assert not await store.delete("alice", "resp_4")

    asyncio.run(run())


def test_the_serve_flags_size_or_turn_off_the_store() -> None:
    from adapters.storage.factory import build_response_store
    from adapters.storage.responses import RedisResponseStore
    from entrypoints.cli import _parser
    from entrypoints.config import ServerConfig

    def access(*argv: str) -> Any:
        return ServerConfig.from_args(_parser().parse_args(["serve", *argv]), device="cpu").access

    default = access()
    assert (default.responses_ttl, default.responses_max_stored) == (24 * 3600.0, 10_000)
    sized = access("--responses-ttl", "60", "--responses-max-stored", "5")
    store = build_response_store(sized.responses_ttl, None, sized.responses_max_stored)
    assert isinstance(store, MemoryResponseStore)
    assert (store.ttl_s, store.max_entries) == (60.0, 5)
    off = access("--responses-ttl", "0")
    assert build_response_store(off.responses_ttl, None, off.responses_max_stored) is None
    shared = build_response_store(60.0, "redis://127.0.0.1:1/0", 5)
    assert isinstance(shared, RedisResponseStore) and shared.ttl_s == 60.0
    for argv, param in [
        (["--responses-ttl", "-1"], "responses_ttl"),
        (["--responses-max-stored", "0"], "responses_max_stored"),
    ]:
        with pytest.raises(InvalidParameterError) as error:
            access(*argv)
        assert error.value.param == param
