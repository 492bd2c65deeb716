"""The fleet routing policy (domain/routing.py): block-hash chains as the engine names its
blocks, the prefix index, and each policy's choices."""

import random
from collections import Counter

import pytest

from domain.kv_blocks import BlockManager
from domain.routing import (
    Policy,
    PrefixIndex,
    ReplicaLoad,
    Router,
    RouteRequest,
    RouterSettings,
    imbalance_for,
    prompt_block_hashes,
)

BLOCK = 4


def _replicas(*queues: int, kv: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", running=q, kv_usage=kv) for i, q in enumerate(queues)]


def _request(tokens: list[int], session: str | None = None) -> RouteRequest:
    return RouteRequest(prompt_block_hashes(tokens, BLOCK), session)


def test_the_chain_is_the_block_managers() -> None:
    tokens = list(range(1, 19))  # 18 tokens: 4 full blocks short of the last token
    manager = BlockManager(num_blocks=16, block_size=BLOCK, enable_caching=True)
    assert manager.allocate("a", len(tokens), adapter_id="lora-x") is not None
    manager.commit("a", tokens, len(tokens))
    found = manager.find_cached_prefix(tokens, "lora-x")
    assert prompt_block_hashes(tokens, BLOCK, "lora-x") == found.block_hashes
    assert len(found.block_hashes) == 4
    assert prompt_block_hashes(tokens, BLOCK) != found.block_hashes  # another namespace
    assert prompt_block_hashes(tokens[:4], BLOCK) == ()  # the last token never counts
    with pytest.raises(ValueError):
        prompt_block_hashes(tokens, 0)


def test_the_index_matches_leading_blocks_and_forgets_the_oldest() -> None:
    index = PrefixIndex(capacity=3)
    a = prompt_block_hashes(list(range(13)), BLOCK)  # 3 blocks
    index.record("r0", a)
    assert index.matched("r0", a) == 3 and index.matched("r1", a) == 0
    index.evicted("r0", a[1:2])
    assert index.matched("r0", a) == 1  # a chain: nothing past a missing block counts
    b = prompt_block_hashes([99, *range(12)], BLOCK)
    index.record("r0", b)  # 3 more: capacity 3 keeps the newest
    assert index.size("r0") == 3 and index.matched("r0", a) == 0 and index.matched("r0", b) == 3
    index.forget("r0")
    assert index.matched("r0", b) == 0


def test_round_robin_takes_turns() -> None:
    router = Router(RouterSettings(policy="round-robin"))
    replicas = _replicas(0, 0, 0)
    chosen = [router.route(_request([1, 2, 3, 4, 5]), replicas).replica_id for _ in range(6)]
    assert chosen == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_pow2_picks_the_lighter_of_two() -> None:
    router = Router(RouterSettings(policy="pow2"), random.Random(0))
    replicas = _replicas(5, 0, 9)
    counts = Counter(router.route(_request([1]), replicas).replica_id for _ in range(300))
    # the busiest is never lighter than the other draw; the idle one wins every draw it is in
    assert counts["r2"] == 0
    assert counts["r1"] > counts["r0"] > 0
    assert router.route(_request([1]), _replicas(3)).replica_id == "r0"  # one replica


def test_prefix_routing_follows_the_cached_prefix() -> None:
    router = Router(RouterSettings(policy="prefix"))
    system = list(range(100, 164))  # a 64-token shared system prompt
    replicas = _replicas(0, 0, 0, 0)
    first = router.route(_request([*system, 1, 2, 3]), replicas)
    assert first.reason == "prefix" and first.matched_blocks == 0
    again = router.route(_request([*system, 7, 8, 9, 10, 11]), replicas)
    assert again.replica_id == first.replica_id and again.matched_blocks == 16
    other = router.route(_request(list(range(500, 600))), replicas)
    assert other.matched_blocks == 0
    # a replica busier by a little still wins on a long match; by a lot (load), not
    busier = [
        ReplicaLoad(r.replica_id, running=3 if r.replica_id == first.replica_id else 1)
        for r in replicas
    ]
    assert router.route(_request([*system, 42]), busier).replica_id == first.replica_id


def test_the_queue_that_counts_is_the_requests_waiting_not_those_running() -> None:
    router = Router(RouterSettings(policy="prefix"))
    system = list(range(100, 132))  # half of the next prompts' blocks
    home = router.route(_request([*system, 1]), _replicas(0, 0)).replica_id

    def prompt(start: int) -> RouteRequest:  # another each time (routing records it)
        return _request([*system, *range(start, start + 33)])

    def load(name: str, waiting: int) -> ReplicaLoad:
        busy = name == home
        return ReplicaLoad(name, running=5 if busy else 0, waiting=waiting if busy else 0)

    names = [r.replica_id for r in _replicas(0, 0)]
    # Running requests leave room in the batch: the half-matched prefix still wins ...
    assert router.route(prompt(200), [load(n, 0) for n in names]).replica_id == home
    # ... requests that wait for room do not.
    assert router.route(prompt(300), [load(n, 3) for n in names]).replica_id != home


def test_an_imbalanced_fleet_yields_to_pow2() -> None:
    router = Router(RouterSettings(policy="prefix", imbalance=4), random.Random(1))
    system = list(range(100, 164))
    replicas = _replicas(0, 0)
    home = router.route(_request([*system, 1]), replicas).replica_id
    loaded = [
        ReplicaLoad(r.replica_id, running=20 if r.replica_id == home else 0) for r in replicas
    ]
    route = router.route(_request([*system, 2]), loaded)
    assert route.reason == "pow2" and route.replica_id != home


def test_kv_usage_breaks_a_tie() -> None:
    router = Router(RouterSettings(policy="prefix"))
    replicas = [ReplicaLoad("full", kv_usage=0.9), ReplicaLoad("empty", kv_usage=0.1)]
    assert router.route(_request(list(range(20))), replicas).replica_id == "empty"


def test_sessions_stick_until_their_replica_is_gone() -> None:
    router = Router(RouterSettings(policy="round-robin"))
    replicas = _replicas(0, 0, 0)
    first = router.route(_request([1, 2], session="run-1"), replicas)
    for _ in range(4):
        route = router.route(_request([3, 4], session="run-1"), replicas)
        assert route.replica_id == first.replica_id and route.reason == "session"
    router.replica_gone(first.replica_id)
    survivors = [r for r in replicas if r.replica_id != first.replica_id]
    moved = router.route(_request([5], session="run-1"), survivors)
    assert moved.replica_id != first.replica_id and moved.reason == "round-robin"
    assert router.route(_request([6], session="run-1"), replicas).replica_id == moved.replica_id
    router.end_session("run-1")
    assert router.route(_request([7], session="run-1"), replicas).reason == "round-robin"


def test_a_request_naming_its_replica_goes_there_while_it_lives() -> None:
    router = Router(RouterSettings(policy="round-robin"))
    replicas = _replicas(0, 5, 0)
    for _ in range(3):
        route = router.route(RouteRequest(replica="r1"), replicas)
        assert route.replica_id == "r1" and route.reason == "owner"
    gone = router.route(RouteRequest(replica="r1"), [r for r in replicas if r.replica_id != "r1"])
    assert gone.replica_id != "r1" and gone.reason == "round-robin"


def _on(adapter: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(prompt_block_hashes(tokens, BLOCK, adapter), adapter=adapter)


@pytest.mark.parametrize("policy", ["prefix", "pow2"])
def test_a_call_on_an_adapter_goes_to_a_replica_holding_it(policy: Policy) -> None:
    """The replicas reporting the adapter take its calls (fresh prompts: no prefix to
    follow) while they are within the imbalance gap, even a little busier than the rest."""
    router = Router(RouterSettings(policy=policy, imbalance=4), random.Random(0))
    router.reported_adapters("r2", ["lora:sql@1"])
    replicas = _replicas(0, 0, 2, 0)
    chosen = {router.route(_on("lora:sql@1", [i, i + 1]), replicas).replica_id for i in range(40)}
    assert chosen == {"r2"}
    # Two hold it: the policy chooses between them by load.
    router.reported_adapters("r0", ["lora:sql@1", "lora:chat@2"])
    assert router.route(_on("lora:sql@1", [9, 9]), replicas).replica_id == "r0"


def test_an_adapter_nobody_holds_goes_by_load_and_sticks_where_it_went() -> None:
    router = Router(RouterSettings(policy="prefix"))
    replicas = _replicas(3, 0, 3)
    first = router.route(_on("lora:new@1", [1, 2]), replicas)
    assert first.replica_id == "r1"  # the lightest: it loads the adapter
    # Until the next report, the router counts the adapter as loaded where it sent it.
    busier = _replicas(3, 2, 1)
    assert router.route(_on("lora:new@1", [5, 6]), busier).replica_id == "r1"
    router.reported_adapters("r1", [])  # evicted there since
    assert router.route(_on("lora:new@1", [7, 8]), busier).replica_id == "r2"


def test_a_holder_past_the_imbalance_gap_is_not_piled_on() -> None:
    router = Router(RouterSettings(policy="prefix", imbalance=4))
    router.reported_adapters("r0", ["lora:sql@1"])
    assert router.route(_on("lora:sql@1", [1, 2]), _replicas(4, 0)).replica_id == "r0"
    route = router.route(_on("lora:sql@1", [3, 4]), _replicas(5, 0))  # 5 > 0 + 4
    assert route.replica_id == "r1"
    router.replica_gone("r0")  # its adapters with it
    assert router.route(_on("lora:sql@1", [5, 6]), _replicas(0, 1)).replica_id == "r1"


def test_round_robin_ignores_adapters() -> None:
    router = Router(RouterSettings(policy="round-robin"))
    router.reported_adapters("r1", ["lora:sql@1"])
    chosen = [router.route(_on("lora:sql@1", [1, 2]), _replicas(0, 0)).replica_id for _ in range(4)]
    assert chosen == ["r0", "r1", "r0", "r1"]


def test_the_imbalance_gap_is_half_a_replicas_batch() -> None:
    assert [imbalance_for(n) for n in (4, 20, 64, 256)] == [10, 10, 32, 128]


def test_bad_settings_and_no_replicas() -> None:
    with pytest.raises(ValueError, match="policy"):
        RouterSettings(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights"):
        RouterSettings(queue_weight=-1)
    with pytest.raises(ValueError, match="no live replica"):
        Router().route(RouteRequest(), [])
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)
