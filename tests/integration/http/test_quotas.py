"""Per-tenant limits on the limits library: requests per second, tokens per minute
(reserved, then settled to use), concurrent streams; refused requests count nothing; in
memory and in a real Redis shared by two "replicas"."""

import pytest

from adapters.storage.rate_limits import LimitsCounters, storage_uri
from application.access.quotas import Quotas
from domain.tenancy import RateLimitedError, Tenant, TenantLimits


def tenant(**limits: int) -> Tenant:
    return Tenant("acme", limits=TenantLimits(**limits))


async def test_requests_per_second_refuse_the_extra_request_and_count_nothing_for_it() -> None:
    quotas, acme = Quotas(LimitsCounters()), tenant(requests_per_second=2)
    first = await quotas.admit(acme)
    assert first.requests is not None and first.requests.remaining == 1
    await quotas.admit(acme)
    for _ in range(3):  # refused ones are not counted: the window stays at its limit
        with pytest.raises(RateLimitedError) as refused:
            await quotas.admit(acme)
    assert refused.value.limit == "requests"
    assert refused.value.state.remaining == 0 and 0 < refused.value.retry_after_s <= 1
    other = Tenant("other", limits=TenantLimits(requests_per_second=2))
    await quotas.admit(other)  # tenants are counted apart


async def test_tokens_are_reserved_then_settled_to_what_was_used() -> None:
    quotas, acme = Quotas(LimitsCounters()), tenant(tokens_per_minute=100)
    a = await quotas.admit(acme)
    await quotas.reserve(a, 60)  # prompt + max_tokens
    b = await quotas.admit(acme)
    with pytest.raises(RateLimitedError) as refused:
        await quotas.reserve(b, 50)
    assert refused.value.limit == "tokens" and refused.value.state.remaining == 40
    await quotas.settle(a, 20)  # used 20 of its 60: 40 come back
    await quotas.settle(a, 20)  # settling twice gives nothing back twice
    await quotas.reserve(b, 80)
    assert b.tokens is not None and b.tokens.remaining == 0
    with pytest.raises(RateLimitedError, match="more than the 100 tokens per minute"):
        await quotas.reserve(await quotas.admit(acme), 101)


async def test_concurrent_streams_are_slots_given_back_at_the_end() -> None:
    refused: list[tuple[str, str]] = []
    quotas = Quotas(LimitsCounters(), on_refused=lambda t, limit: refused.append((t, limit)))
    acme = tenant(max_concurrent_streams=1, tokens_per_minute=1000)
    a = await quotas.admit(acme)
    await quotas.reserve(a, 10)
    b = await quotas.admit(acme)
    with pytest.raises(RateLimitedError) as e:
        await quotas.reserve(b, 10)
    assert e.value.limit == "streams"
    assert refused == [("acme", "streams")]
    # The refused request's tokens were given back: only a's 10 are taken.
    await quotas.settle(a, 10)
    await quotas.reserve(b, 990)


def test_a_redis_url_must_be_one() -> None:
    assert storage_uri(None) == "async+memory://"
    assert storage_uri("redis://h:6379/0") == "async+redis://h:6379/0"
    with pytest.raises(ValueError, match="redis://"):
        storage_uri("http://h:6379")


async def test_two_replicas_share_their_limits_through_redis(redis_url: str) -> None:
    one = Quotas(LimitsCounters(redis_url, prefix="test-share"))
    two = Quotas(LimitsCounters(redis_url, prefix="test-share"))
    acme = tenant(requests_per_second=3, tokens_per_minute=100, max_concurrent_streams=1)
    a = await one.admit(acme)
    b = await two.admit(acme)
    await one.reserve(a, 70)
    with pytest.raises(RateLimitedError):
        await two.reserve(b, 40)  # one's reservation is seen by two
    await one.settle(a, 30)  # a ends: 40 tokens and its stream slot come back
    await two.reserve(b, 40)
    c = await one.admit(acme)
    with pytest.raises(RateLimitedError) as refused:
        await two.admit(acme)  # the third request of the second, across replicas
    assert refused.value.limit == "requests"
    with pytest.raises(RateLimitedError) as streams:
        await one.reserve(c, 1)  # b holds the one stream slot
    assert streams.value.limit == "streams"
    await two.settle(b, 40)
    await one.reserve(c, 1)
