"""Daily quotas (``requests_per_day``, ``tokens_per_day``): counted in one-day fixed
windows beside the per-second/minute limits, tokens reserved and settled in each window
(given back only within the window they were taken in), nothing held by a refused
request, usage seeded at start-up; read from the keys file; 429s on the OpenAI and Tinker
faces."""

import json
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.fake.tokenizer import ByteTokenizer
from adapters.http.tinker import tinker_router
from adapters.storage.keys_file import KeysFileError, load_keyring
from adapters.storage.rate_limits import LimitsCounters
from application.access.access import Access
from application.access.keys import Keyring, hash_key
from application.access.quotas import DAY, MINUTE, Quotas
from domain.tenancy import RateLimitedError, Tenant, TenantLimits, WindowState
from tests.fakes import ManualClock, fake_container
from tests.support.tinker_client import Api, forward_backward_proto, post_proto
from tests.support.tinker_server import toy_service


class WindowCounters:
    """The :class:`RateLimitCounters` port in fixed windows on a manual clock: a window
    starts at its first count and lasts ``window_s``."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.windows: dict[str, tuple[float, int]] = {}  # name -> (reset time, count)
        self.slots: dict[str, int] = {}

    def _window(self, name: str, window_s: int) -> tuple[float, int]:
        reset, count = self.windows.get(name, (0.0, 0))
        if self.clock() >= reset:
            reset, count = self.clock() + window_s, 0
        return reset, count

    def used(self, name: str) -> int:
        reset, count = self.windows.get(name, (0.0, 0))
        return count if self.clock() < reset else 0

    async def take(
        self, name: str, amount: int, limit: int, window_s: int
    ) -> tuple[bool, WindowState]:
        reset, count = self._window(name, window_s)
        ok = count + amount <= limit
        if ok:
            count += amount
        self.windows[name] = (reset, count)
        return ok, WindowState(limit, limit - count, reset - self.clock())

    async def give_back(self, name: str, amount: int, limit: int, window_s: int) -> None:
        await self.charge(name, -amount, limit, window_s)

    async def charge(self, name: str, amount: int, limit: int, window_s: int) -> None:
        reset, count = self._window(name, window_s)
        self.windows[name] = (reset, count + amount)

    async def enter(self, name: str, limit: int) -> bool:
        if self.slots.get(name, 0) >= limit:
            return False
        self.slots[name] = self.slots.get(name, 0) + 1
        return True

    async def leave(self, name: str) -> None:
        self.slots[name] -= 1


def quotas_on_a_clock() -> tuple[Quotas, WindowCounters, ManualClock]:
    clock = ManualClock()
    counters = WindowCounters(clock)
    return Quotas(counters, clock=clock), counters, clock


def acme(**limits: int) -> Tenant:
    return Tenant("acme", limits=TenantLimits(**limits))


async def test_requests_per_day_refuse_until_the_day_window_resets() -> None:
    refused: list[tuple[str, str]] = []
    clock = ManualClock()
    counters = WindowCounters(clock)
    quotas = Quotas(counters, clock=clock, on_refused=lambda t, limit: refused.append((t, limit)))
    tenant = acme(requests_per_day=2, requests_per_minute=10)
    first = await quotas.admit(tenant)
    # The headers report the tightest request window: the day's.
    assert first.requests == WindowState(2, 1, DAY)
    clock.now += 3600
    await quotas.admit(tenant)
    clock.now += 3600
    with pytest.raises(RateLimitedError, match="daily quota reached: 2 requests per day") as e:
        await quotas.admit(tenant)
    assert e.value.limit == "requests" and e.value.state.remaining == 0
    assert e.value.retry_after_s == DAY - 2 * 3600  # the window began at the first request
    assert refused == [("acme", "requests")]
    # The refused request counted nothing in the minute window either.
    assert counters.used(f"requests/{MINUTE}:acme") == 0
    clock.now += DAY - 2 * 3600
    assert (await quotas.admit(tenant)).requests == WindowState(2, 1, DAY)


async def test_a_request_refused_by_the_minute_is_not_counted_in_its_day() -> None:
    quotas, counters, _ = quotas_on_a_clock()
    tenant = acme(requests_per_second=1, requests_per_day=5)
    first = await quotas.admit(tenant)
    assert first.requests == WindowState(1, 0, 1)  # the tightest window: the second's
    with pytest.raises(RateLimitedError, match="rate limit reached: 1 requests per second"):
        await quotas.admit(tenant)
    assert counters.used(f"requests/{DAY}:acme") == 1


async def test_a_request_larger_than_the_daily_tokens_is_refused_holding_nothing() -> None:
    quotas, counters, _ = quotas_on_a_clock()
    tenant = acme(tokens_per_minute=1000, tokens_per_day=100)
    admission = await quotas.admit(tenant)
    with pytest.raises(RateLimitedError, match="more than the 100 tokens per day") as e:
        await quotas.reserve(admission, 101)
    assert e.value.limit == "tokens"
    assert counters.used("tokens:acme") == 0 and counters.used("tokens/day:acme") == 0


async def test_tokens_are_reserved_and_settled_in_the_minute_and_the_day() -> None:
    quotas, counters, clock = quotas_on_a_clock()
    tenant = acme(tokens_per_minute=50, tokens_per_day=100)
    a = await quotas.admit(tenant)
    await quotas.reserve(a, 40)
    assert a.reserved_tokens == 40
    assert a.tokens == WindowState(50, 10, MINUTE)  # the tighter window
    await quotas.settle(a, 15)  # 25 come back in both windows
    await quotas.settle(a, 15)  # settling twice gives nothing back twice
    assert counters.used("tokens:acme") == 15 and counters.used("tokens/day:acme") == 15
    b = await quotas.admit(tenant)
    await quotas.reserve(b, 30)
    await quotas.settle(b, 45)  # use beyond the reservation is counted in both
    assert counters.used("tokens:acme") == 60 and counters.used("tokens/day:acme") == 60
    clock.now += MINUTE  # a new minute, the same day
    c = await quotas.admit(tenant)
    await quotas.reserve(c, 40)
    assert c.tokens == WindowState(100, 0, DAY - MINUTE)  # now the day is tighter
    d = await quotas.admit(tenant)
    with pytest.raises(RateLimitedError, match="daily quota reached: 100 tokens per day") as e:
        await quotas.reserve(d, 1)
    assert e.value.state.remaining == 0
    # The minute window took the 1 token before the day refused it: it was given back.
    assert counters.used("tokens:acme") == 40 and counters.used("tokens/day:acme") == 100


async def test_the_unused_tokens_go_back_only_to_windows_that_have_not_reset() -> None:
    quotas, counters, clock = quotas_on_a_clock()
    tenant = acme(tokens_per_minute=100, tokens_per_day=1000)
    a = await quotas.admit(tenant)
    await quotas.reserve(a, 80)
    clock.now += MINUTE + 1  # the minute it was taken in reset; the day did not
    b = await quotas.admit(tenant)
    await quotas.reserve(b, 30)
    await quotas.settle(a, 0)
    # The day gets a's 80 back; the new minute keeps b's 30 (not 30 - 80).
    assert counters.used("tokens/day:acme") == 30
    assert counters.used("tokens:acme") == 30
    c = await quotas.admit(tenant)
    with pytest.raises(RateLimitedError, match="100 tokens per minute"):
        await quotas.reserve(c, 71)
    assert counters.used("tokens/day:acme") == 30  # the refusal kept nothing in the day


async def test_a_stream_refusal_gives_back_both_windows() -> None:
    quotas, counters, _ = quotas_on_a_clock()
    tenant = acme(tokens_per_minute=100, tokens_per_day=1000, max_concurrent_streams=1)
    a = await quotas.admit(tenant)
    await quotas.reserve(a, 10)
    b = await quotas.admit(tenant)
    with pytest.raises(RateLimitedError) as e:
        await quotas.reserve(b, 20)
    assert e.value.limit == "streams"
    assert counters.used("tokens:acme") == 10 and counters.used("tokens/day:acme") == 10


async def test_seeded_usage_counts_against_the_daily_quotas_only() -> None:
    quotas, counters, _ = quotas_on_a_clock()
    tenant = acme(requests_per_day=3, tokens_per_day=100, requests_per_minute=10)
    await quotas.seed(tenant, 2, 90)
    assert counters.used(f"requests/{MINUTE}:acme") == 0 and counters.used("tokens:acme") == 0
    admission = await quotas.admit(tenant)
    with pytest.raises(RateLimitedError, match="daily quota reached: 100 tokens per day"):
        await quotas.reserve(admission, 11)
    await quotas.reserve(admission, 10)
    with pytest.raises(RateLimitedError, match="daily quota reached: 3 requests per day"):
        await quotas.admit(tenant)
    # Seeding counts beyond the limit, and nothing without a daily limit or an amount.
    await quotas.seed(tenant, 0, 0)
    await quotas.seed(acme(requests_per_minute=1, tokens_per_minute=5), 7, 70)
    assert counters.windows.keys() == {
        f"requests/{DAY}:acme",
        f"requests/{MINUTE}:acme",
        "tokens/day:acme",
    }


async def test_seed_and_daily_quotas_on_the_limits_library() -> None:
    quotas, tenant = Quotas(LimitsCounters()), acme(requests_per_day=2, tokens_per_day=50)
    await quotas.seed(tenant, 1, 40)
    admission = await quotas.admit(tenant)
    assert admission.requests is not None and admission.requests.remaining == 0
    assert 0 < admission.requests.reset_s <= DAY
    with pytest.raises(RateLimitedError, match="daily quota reached: 50 tokens per day") as e:
        await quotas.reserve(admission, 11)
    assert e.value.state.remaining == 10
    await quotas.reserve(admission, 10)
    await quotas.settle(admission, 4)  # 6 come back
    again = Tenant("acme", limits=TenantLimits(tokens_per_day=50))
    second = await quotas.admit(again)
    await quotas.reserve(second, 6)
    assert second.tokens is not None and second.tokens.remaining == 0
    with pytest.raises(RateLimitedError, match="2 requests per day"):
        await quotas.admit(tenant)


def test_the_keys_file_reads_the_daily_quotas(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[tenants]]\nid = "acme"\nkeys = ["{hash_key("sk-a")}"]\n'
        "requests_per_day = 1000\ntokens_per_day = 200000\n"
        f'[[tenants]]\nid = "free"\nkeys = ["{hash_key("sk-f")}"]\n'
    )
    keyring = load_keyring(path)
    tenant = keyring.tenant("sk-a")
    assert tenant is not None
    assert (tenant.limits.requests_per_day, tenant.limits.tokens_per_day) == (1000, 200000)
    free = keyring.tenant("sk-f")
    assert free is not None and free.limits == TenantLimits()


@pytest.mark.parametrize(
    ("field", "value"),
    [("requests_per_day", 0), ("tokens_per_day", "many"), ("tokens_per_day", True)],
)
def test_a_bad_daily_quota_is_refused(tmp_path: Path, field: str, value: Any) -> None:
    path = tmp_path / "keys.json"
    tenant = {"id": "a", "keys": [hash_key("k")], field: value}
    path.write_text(json.dumps({"tenants": [tenant]}))
    with pytest.raises(KeysFileError, match=f"`{field}` must be a positive integer"):
        load_keyring(path)


def openai_client(tmp_path: Path, **limits: int) -> TestClient[Any]:
    path = tmp_path / "keys.json"
    tenant = {"id": "acme", "keys": [hash_key("sk-acme")], **limits}
    path.write_text(json.dumps({"tenants": [tenant]}))
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok" * 10))
    container = fake_container(runner, cache_dir=str(tmp_path), api_keys_file=str(path))
    return TestClient(app=container.http_app())


def complete(client: TestClient[Any], max_tokens: int = 4) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hi", "max_tokens": max_tokens},
        headers={"Authorization": "Bearer sk-acme"},
    )


def test_the_second_request_over_a_daily_quota_of_one_is_a_429(tmp_path: Path) -> None:
    with openai_client(tmp_path, requests_per_day=1, requests_per_minute=10) as client:
        first = complete(client)
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-limit-requests"] == "1"  # the tightest window
        assert first.headers["x-ratelimit-remaining-requests"] == "0"
        refused = complete(client)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "daily quota reached: 1 requests per day" in error["message"]
        assert 3600 < int(refused.headers["retry-after"]) <= DAY


def test_tokens_per_day_on_the_openai_face(tmp_path: Path) -> None:
    with openai_client(tmp_path, tokens_per_day=40) as client:
        too_big = complete(client, max_tokens=50)
        assert too_big.status_code == 429
        assert "more than the 40 tokens per day" in too_big.json()["error"]["message"]
        first = complete(client, max_tokens=20)  # 3 prompt tokens + 20 reserved
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-remaining-tokens"] == str(40 - 23)
        used = first.json()["usage"]["total_tokens"]
        over = complete(client, max_tokens=40 - used - 3 + 1)  # one more than is left
        assert over.status_code == 429
        assert "daily quota reached: 40 tokens per day" in over.json()["error"]["message"]
        assert complete(client, max_tokens=40 - used - 3).status_code == 200


def test_daily_quotas_on_the_tinker_face(tmp_path: Path) -> None:
    limits = TenantLimits(requests_per_day=3, tokens_per_day=1000)
    keyring = Keyring([(hash_key("tml-acme"), Tenant("acme", limits=limits))])
    access = Access(keyring, Quotas(LimitsCounters()))
    app = Litestar(route_handlers=[tinker_router(toy_service(tmp_path), access=access)])
    with TestClient(app) as client:
        api = Api(client, {"X-API-Key": "tml-acme"})
        model = api.model(api.session())  # two requests
        api.result(api.forward_backward(model, 1))  # the third
        refused = post_proto(client, forward_backward_proto(model, 2), api.headers)
        assert refused.status_code == 429, refused.text
        assert "daily quota reached: 3 requests per day" in refused.json()["detail"]
