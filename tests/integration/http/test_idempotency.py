"""Idempotency-Key: a repeat with the same key and body gets the stored
reply without running again (streams included); another body or a duplicate in progress
is a 409; store=false is never stored; failures free the key; keys are per caller; the
Redis store shares replies between replicas."""

import threading
import time
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner
from adapters.storage.idempotency import RedisIdempotencyStore
from application.access.idempotency import MemoryIdempotencyStore
from domain.idempotency import IdempotencyStore, StoredReply
from tests.fakes import fake_container


class CountingRunner(FakeModelRunner):
    """Counts the requests it starts; each reply differs (a counter), so a replay shows."""

    def __init__(self, step_latency_s: float = 0.0) -> None:
        self.started = 0
        tokenizer = ByteTokenizer()

        def script(request: Any) -> int:
            if not request.generated_token_ids:
                self.started += 1
            return tokenizer.encode(str(self.started % 10), add_special_tokens=False)[0]

        super().__init__(script=script, step_latency_s=step_latency_s)


def make_client(tmp_path: Any, **kwargs: Any) -> tuple[TestClient, CountingRunner]:
    runner = CountingRunner(kwargs.pop("step_latency_s", 0.0))
    container = fake_container(runner, cache_dir=str(tmp_path), **kwargs)
    return TestClient(app=container.http_app()), runner  # type: ignore[arg-type]


BODY = {"model": "fake", "prompt": "Hi", "max_tokens": 3}


def post(client: TestClient, key: str | None, body: dict[str, Any] = BODY, **headers: str) -> Any:
    extra = {"Idempotency-Key": key} if key is not None else {}
    return client.post("/v1/completions", json=body, headers={**extra, **headers})


def test_a_repeat_gets_the_stored_reply_without_running_again(tmp_path) -> None:
    client, runner = make_client(tmp_path)
    with client:
        first = post(client, "k1")
        again = post(client, "k1")
        assert first.status_code == again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true"
        assert "idempotent-replayed" not in first.headers
        assert again.json() == first.json()
        assert runner.started == 1
        assert post(client, "k2").json()["choices"] != first.json()["choices"]  # runs anew
        assert runner.started == 2
        assert post(client, None).status_code == 200 and runner.started == 3


def test_a_stream_is_replayed_whole(tmp_path) -> None:
    client, runner = make_client(tmp_path)
    body = {**BODY, "stream": True}
    with client:
        first = post(client, "s", body)
        again = post(client, "s", body)
    assert first.text == again.text and "data: [DONE]" in again.text
    assert again.headers["content-type"].startswith("text/event-stream")
    assert runner.started == 1


def test_another_body_or_a_duplicate_in_progress_is_a_409(tmp_path) -> None:
    client, _ = make_client(tmp_path, step_latency_s=0.1)
    with client:
        assert post(client, "k").status_code == 200
        conflict = post(client, "k", {**BODY, "max_tokens": 2})
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "idempotency_key_conflict"
        results: list[Any] = []
        slow = {**BODY, "max_tokens": 6}
        thread = threading.Thread(target=lambda: results.append(post(client, "busy", slow)))
        thread.start()
        time.sleep(0.25)
        duplicate = post(client, "busy", slow)
        thread.join()
        assert duplicate.status_code == 409 and "in progress" in duplicate.text
        assert results[0].status_code == 200
        assert post(client, "busy", slow).headers["idempotent-replayed"] == "true"


def test_keys_are_per_caller_and_store_false_is_never_stored(tmp_path) -> None:
    client, runner = make_client(tmp_path)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with client:
        post(client, "k", Authorization="Bearer a")
        post(client, "k", Authorization="Bearer b")
        assert runner.started == 2  # another caller's key is another key
        for _ in range(2):
            response = client.post(
                "/v1/chat/completions",
                json={**chat, "store": False},
                headers={"Idempotency-Key": "nostore"},
            )
            assert response.status_code == 200 and "idempotent-replayed" not in response.headers
        assert runner.started == 4


def test_a_failed_request_frees_its_key_and_bad_keys_are_400(tmp_path) -> None:
    client, _ = make_client(tmp_path)
    with client:
        assert post(client, "x" * 300).status_code == 400
        # A 4xx reply is stored like any other (the same request gets the same answer).
        bad = {**BODY, "temperature": -1}
        assert post(client, "bad", bad).status_code == 400
        assert post(client, "bad", bad).headers["idempotent-replayed"] == "true"
    calls = [0]

    def fail_once(_: Any) -> int:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the device fell over")
        return 65

    container = fake_container(FakeModelRunner(script=fail_once), cache_dir=str(tmp_path))
    with TestClient(app=container.http_app()) as failing:  # type: ignore[arg-type]
        assert post(failing, "retry").status_code == 500
        retried = post(failing, "retry")  # the 5xx was not stored: it runs again
        assert retried.status_code == 200 and "idempotent-replayed" not in retried.headers


def test_off_when_the_retention_is_zero(tmp_path) -> None:
    client, runner = make_client(tmp_path, idempotency_ttl=0)
    with client:
        post(client, "k")
        assert "idempotent-replayed" not in post(client, "k").headers
    assert runner.started == 2


async def run_once_then_replay(
    first: IdempotencyStore, second: IdempotencyStore, key: str, reply: StoredReply, ttl: int
) -> None:
    """``key`` begun in ``first`` (fingerprint ``f``) runs once: ``second`` sees it running,
    or in conflict for another fingerprint; once ``first`` finished it, ``second`` replays."""
    assert await first.begin(key, "f", ttl) == "new"
    assert await second.begin(key, "f", ttl) == "running"
    assert await second.begin(key, "g", ttl) == "conflict"
    await first.finish(key, "f", reply, ttl)
    assert await second.begin(key, "f", ttl) == reply


async def test_the_memory_store_expires_and_is_bounded() -> None:
    now = [0.0]
    store = MemoryIdempotencyStore(max_entries=2, clock=lambda: now[0])
    reply = StoredReply(200, (("content-type", "application/json"),), b"{}")
    await run_once_then_replay(store, store, "a", reply, 10)
    now[0] = 11
    assert await store.begin("a", "f", 10) == "new"  # expired
    await store.begin("b", "f", 10)
    await store.begin("c", "f", 10)
    assert len(store) == 2  # the oldest went
    await store.abandon("c")
    assert await store.begin("c", "f", 10) == "new"


async def test_the_redis_store_is_shared(redis_url: str) -> None:
    one, two = RedisIdempotencyStore(redis_url), RedisIdempotencyStore(redis_url)
    reply = StoredReply(200, (("content-type", "text/event-stream"),), b"data: x\n\n")
    await run_once_then_replay(one, two, "shared", reply, 60)
    await two.abandon("shared")
    assert await one.begin("shared", "f", 60) == "new"
