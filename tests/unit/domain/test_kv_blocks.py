"""The paged KV block manager (domain/kv_blocks.py): pool, tables, prefix cache, eviction."""

import random
from dataclasses import dataclass, field

import pytest

from domain.kv_blocks import BlockManager, CachedPrefix, hash_block

BS = 4  # a tiny block size keeps the arithmetic readable


def manager(num_blocks: int = 8, **kwargs: bool) -> BlockManager:
    return BlockManager(num_blocks, BS, **kwargs)


def computed(m: BlockManager, request_id: str, tokens: list[int], **kwargs) -> list[int]:
    """Allocate a request's whole ``tokens`` and mark their KV computed; its table."""
    assert m.allocate(request_id, len(tokens), **kwargs) is not None
    m.commit(request_id, tokens, len(tokens))
    return m.block_table(request_id)


def check_invariants(m: BlockManager) -> None:
    """Each block empty, cached or referenced (exactly one); refcounts = table holdings."""
    empty, cached = list(m._empty), list(m._cached)
    assert len(set(empty)) == len(empty) and not set(empty) & set(cached)
    holders = [b for entry in m._requests.values() for b in entry.block_ids]
    for entry in m._requests.values():
        assert len(set(entry.block_ids)) == len(entry.block_ids)
        assert len(entry.block_hashes) <= len(entry.block_ids)
    for block in m.blocks:
        assert block.ref_count == holders.count(block.block_id)
        in_empty, in_cached = block.block_id in empty, block.block_id in cached
        assert in_empty + in_cached + (block.ref_count > 0) == 1
        assert not (in_empty and block.block_hash is not None)
        assert not (in_cached and block.block_hash is None)
        if block.block_hash is not None:
            assert m._by_hash[block.block_hash] == block.block_id
    assert len(m._by_hash) == sum(b.block_hash is not None for b in m.blocks)
    referenced = sum(b.ref_count > 0 for b in m.blocks)
    assert m.num_free_blocks + referenced == m.num_blocks


# Allocation, growth, free


def test_allocate_takes_whole_blocks_for_the_positions() -> None:
    m = manager()
    assert m.allocate("a", 5) == [0, 1]
    assert m.block_table("a") == [0, 1] and "a" in m
    assert m.num_free_blocks == 6 and m.usage == pytest.approx(2 / 8)
    check_invariants(m)


def test_growing_within_a_block_adds_nothing_and_across_a_boundary_adds_one() -> None:
    m = manager()
    m.allocate("a", 3)
    assert m.allocate("a", 4) == []  # the block fills up
    assert m.allocate("a", 5) == [1]  # position 4 opens the second block
    assert m.allocate("a", 2) == []  # never shrinks
    assert m.block_table("a") == [0, 1]
    check_invariants(m)


def test_allocate_is_all_or_nothing_and_none_when_blocks_run_out() -> None:
    m = manager(num_blocks=3)
    m.allocate("a", 8)
    assert not m.can_allocate("b", 5)
    assert m.allocate("b", 5) is None
    assert "b" not in m and m.num_free_blocks == 1
    assert m.allocate("a", 13) is None and m.block_table("a") == [0, 1]
    assert m.allocate("b", 4) == [2]
    check_invariants(m)


def test_free_returns_the_blocks_and_ignores_unknown_or_repeated_ids() -> None:
    m = manager()
    m.allocate("a", 9)
    m.free("a")
    m.free("a")
    m.free("never-allocated")
    assert "a" not in m and m.block_table("a") == []
    assert m.num_free_blocks == 8 and m.usage == 0.0
    check_invariants(m)


def test_the_pool_must_have_a_block_of_a_position() -> None:
    with pytest.raises(ValueError):
        BlockManager(0)
    with pytest.raises(ValueError):
        BlockManager(4, block_size=0)


# Prefix cache: hits, misses, adapters


def test_a_computed_prefix_is_found_in_whole_blocks() -> None:
    m = manager()
    table = computed(m, "a", list(range(10)))
    prefix = m.find_cached_prefix([*range(10), 99])
    assert prefix.block_ids == tuple(table[:2]) and prefix.num_tokens == 8
    assert prefix.num_queried_tokens == 11


def test_the_last_token_is_never_served_from_the_cache() -> None:
    m = manager()
    computed(m, "a", list(range(8)))
    assert m.find_cached_prefix(list(range(8))).num_tokens == 4  # position 7 must run
    assert m.find_cached_prefix(list(range(9))).num_tokens == 8


def test_blocks_are_named_only_once_full_and_computed() -> None:
    m = manager()
    tokens = list(range(12))
    m.allocate("a", 12)
    assert m.find_cached_prefix([*tokens, 0]).num_tokens == 0  # KV not computed yet
    m.commit("a", tokens, 6)  # one full block computed, the second half done
    assert m.find_cached_prefix([*tokens, 0]).num_tokens == 4
    m.commit("a", tokens, 12)
    assert m.find_cached_prefix([*tokens, 0]).num_tokens == 12


def test_a_different_block_ends_the_hit_and_the_chain_covers_what_came_before() -> None:
    m = manager()
    computed(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 0, 9]).num_tokens == 4
    # The same second block after a different first one is another block's KV.
    assert m.find_cached_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0


def test_hashes_are_keyed_by_adapter() -> None:
    m = manager()
    tokens = list(range(9))
    computed(m, "a", tokens, adapter_id="math")
    assert m.find_cached_prefix(tokens, "math").num_tokens == 8
    assert m.find_cached_prefix(tokens).num_tokens == 0
    assert m.find_cached_prefix(tokens, "code").num_tokens == 0
    assert hash_block(b"", [1], None) != hash_block(b"", [1], "")
    assert hash_block(b"", [1], "a") != hash_block(b"", [1], "b")


def test_a_hit_shares_the_blocks_and_counts_the_tokens() -> None:
    m = manager()
    table = computed(m, "a", list(range(10)))
    tokens = [*range(8), 50, 51]
    prefix = m.find_cached_prefix(tokens)
    assert m.allocate("b", 10, prefix=prefix) == [*table[:2], 3]
    assert m.block_table("b") == [*table[:2], 3]
    assert [m.blocks[b].ref_count for b in table] == [2, 2, 1]
    assert (m.prefix_queried_tokens, m.prefix_hit_tokens) == (10, 8)
    assert m.prefix_hit_rate == pytest.approx(0.8)
    check_invariants(m)


def test_a_request_freed_and_readmitted_finds_its_own_tokens_cached() -> None:
    m = manager()
    tokens = list(range(11))  # prompt + generated tokens at a preemption
    table = computed(m, "a", tokens)
    m.free("a")
    assert m.num_cached_blocks == 2
    prefix = m.find_cached_prefix(tokens)
    assert prefix.block_ids == tuple(table[:2]) and prefix.num_tokens == 8
    assert m.allocate("a", 11, prefix=prefix) is not None
    assert m.block_table("a")[:2] == table[:2] and m.num_cached_blocks == 0
    check_invariants(m)


def test_a_prefix_in_cached_free_blocks_counts_against_the_free_pool() -> None:
    m = manager(num_blocks=3)
    computed(m, "a", list(range(8)))
    m.free("a")  # two cached blocks, one empty
    prefix = m.find_cached_prefix(list(range(9)))
    assert prefix.num_tokens == 8
    assert m.can_allocate("b", 12, prefix)  # the empty block covers positions 8..11
    assert not m.can_allocate("b", 13, prefix)  # another one would evict the prefix
    assert m.allocate("b", 13, prefix=prefix) is None
    assert m.allocate("b", 12, prefix=prefix) == [0, 1, 2]


def test_the_same_content_computed_twice_is_named_once() -> None:
    m = manager()
    tokens = list(range(5))
    first = computed(m, "a", tokens)
    second = computed(m, "b", tokens)  # admitted before a's KV was there
    assert second[0] != first[0]
    assert m.find_cached_prefix(tokens).block_ids == (first[0],)
    m.free("b")
    assert m.num_cached_blocks == 0  # b's duplicate caches nothing
    check_invariants(m)


def test_without_caching_nothing_is_found_or_kept() -> None:
    m = manager(enable_caching=False)
    computed(m, "a", list(range(9)))
    assert m.find_cached_prefix(list(range(9))) == CachedPrefix(num_queried_tokens=9)
    m.free("a")
    assert m.num_cached_blocks == 0
    check_invariants(m)


# Eviction order


def test_empty_blocks_are_used_before_cached_ones_are_evicted() -> None:
    m = manager(num_blocks=4)
    computed(m, "a", list(range(8)))
    m.free("a")
    assert m.allocate("b", 8) == [2, 3]
    assert m.find_cached_prefix(list(range(9))).num_tokens == 8  # a's blocks survive


def test_evicted_blocks_are_reported_once_by_hash() -> None:
    m = manager(num_blocks=2)
    computed(m, "a", list(range(8)))
    chain = m.find_cached_prefix(list(range(9))).block_hashes
    m.free("a")
    assert m.take_evicted() == []
    assert m.allocate("b", 4) is not None  # evicts a's tail, then nothing more
    assert m.take_evicted() == [chain[1]]
    assert m.take_evicted() == []
    check_invariants(m)


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_before_head() -> None:
    m = manager(num_blocks=4)
    old = computed(m, "old", list(range(8)))
    new = computed(m, "new", list(range(100, 108)))
    m.free("old")
    m.free("new")
    # old's tail, then old's head, then new's tail.
    assert m.allocate("c", 4) == [old[1]]
    assert m.find_cached_prefix(list(range(9))).num_tokens == 4
    assert m.allocate("c", 8) == [old[0]]
    assert m.allocate("c", 12) == [new[1]]
    assert m.find_cached_prefix(list(range(100, 109))).num_tokens == 4
    assert m.find_cached_prefix(list(range(9))).num_tokens == 0
    check_invariants(m)


def test_a_hit_takes_a_block_out_of_the_eviction_order() -> None:
    m = manager(num_blocks=2)
    computed(m, "a", list(range(4)))
    m.free("a")
    m.allocate("b", 5, prefix=m.find_cached_prefix(list(range(5))))
    m.free("b")  # block 0 freed again, after block 1: block 1 is evicted first
    assert m.allocate("c", 4) == [1]


# Reference counts and forks


def test_reference_counts_follow_the_tables_that_hold_a_block() -> None:
    m = manager()
    tokens = list(range(9))
    table = computed(m, "a", tokens)
    for name in "bc":
        m.allocate(name, 9, prefix=m.find_cached_prefix(tokens))
    assert [m.blocks[b].ref_count for b in table[:2]] == [3, 3]
    m.free("a")
    m.free("b")
    assert [m.blocks[b].ref_count for b in table[:2]] == [1, 1]
    assert m.num_cached_blocks == 0  # still referenced by c
    m.free("c")
    assert m.num_cached_blocks == 2
    check_invariants(m)


def test_a_fork_shares_the_full_blocks_and_recomputes_the_partial_one() -> None:
    m = manager()
    prompt = list(range(11))
    source = computed(m, "a", prompt[:10])  # the source computed all but the last token
    assert m.fork("a", "a.1", 10) == 8
    assert m.block_table("a.1") == source[:2]
    assert [m.blocks[b].ref_count for b in source] == [2, 2, 1]
    assert m.allocate("a.1", 11) == [3]  # positions 8..10 in a block of its own
    m.commit("a.1", prompt, 11)
    m.free("a")
    assert m.block_table("a.1") == [*source[:2], 3]
    assert [m.blocks[b].ref_count for b in source[:2]] == [1, 1]
    check_invariants(m)


def test_a_fork_shares_no_more_than_the_source_holds() -> None:
    m = manager()
    m.allocate("a", 4)
    assert m.fork("a", "b", 100) == 4
    assert m.fork("a", "c", 3) == 0 and m.block_table("c") == []
    check_invariants(m)


# A long random life: admissions, growth, preemption, forks, aborts, finishes


@dataclass
class Sim:
    request_id: str
    tokens: list[int]
    adapter_id: str | None
    max_len: int
    computed: int = 0
    kv: dict[int, tuple] = field(default_factory=dict)


class RandomLife:
    """A scheduler's use of the manager, with a shadow of what each block's KV holds: the
    (adapter, tokens up to and including the position) it was computed from."""

    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [7] * 13)

    def __init__(self, seed: int, num_blocks: int = 24) -> None:
        self.rng = random.Random(seed)
        self.m = BlockManager(num_blocks, BS)
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> content
        self.running: dict[str, Sim] = {}
        self.waiting: list[Sim] = []
        self.counter = 0
        self.preemptions = self.forks = 0

    def new_request(self) -> Sim:
        self.counter += 1
        tokens = list(self.rng.choice(self.PREFIXES))
        tokens += [self.rng.randrange(4) for _ in range(self.rng.randint(1, 6))]
        adapter = self.rng.choice([None, None, "x"])
        return Sim(f"r{self.counter}", tokens, adapter, len(tokens) + self.rng.randint(0, 12))

    def content(self, sim: Sim, position: int) -> tuple:
        return (sim.adapter_id, tuple(sim.tokens[: position + 1]))

    def compute(self, sim: Sim, target: int) -> None:
        """The runner writes positions computed..target, then the scheduler commits."""
        table = self.m.block_table(sim.request_id)
        for position in range(sim.computed, target):
            block = table[position // BS]
            assert self.m.blocks[block].ref_count == 1, "wrote into a shared block"
            self.kv[block, position % BS] = self.content(sim, position)
        sim.computed = target
        self.m.commit(sim.request_id, sim.tokens, target)

    def admit(self) -> None:
        sim = self.waiting.pop(0) if self.waiting else self.new_request()
        prefix = self.m.find_cached_prefix(sim.tokens, sim.adapter_id)
        assert prefix.num_tokens < len(sim.tokens) and prefix.num_tokens % BS == 0
        for position in range(prefix.num_tokens):  # a hit holds this request's KV
            slot = (prefix.block_ids[position // BS], position % BS)
            assert self.kv[slot] == self.content(sim, position)
        target = self.rng.randint(prefix.num_tokens + 1, len(sim.tokens))
        got = self.m.allocate(sim.request_id, target, adapter_id=sim.adapter_id, prefix=prefix)
        if got is None:
            assert sim.request_id not in self.m
            self.waiting.insert(0, sim)
            return
        sim.computed = prefix.num_tokens
        self.running[sim.request_id] = sim
        self.compute(sim, target)

    def grow(self) -> None:
        sim = self.rng.choice(list(self.running.values()))
        if sim.computed == len(sim.tokens):
            if len(sim.tokens) >= sim.max_len:
                return self.end(sim)
            sim.tokens.append(self.rng.randrange(4))  # the token sampled last step
        target = self.rng.randint(sim.computed + 1, len(sim.tokens))
        while self.m.allocate(sim.request_id, target) is None:
            victim = list(self.running.values())[-1]  # the newest
            self.preempt(victim)
            if victim is sim:
                return
        self.compute(sim, target)

    def preempt(self, sim: Sim) -> None:
        self.preemptions += 1
        self.m.free(sim.request_id)
        del self.running[sim.request_id]
        sim.computed = 0
        self.waiting.insert(0, sim)

    def fork(self) -> None:
        source = self.rng.choice(list(self.running.values()))
        self.counter += 1
        shared_len = self.rng.randint(0, source.computed)
        tail = [self.rng.randrange(4) for _ in range(self.rng.randint(1, 4))]
        tokens = source.tokens[:shared_len] + tail
        sim = Sim(f"r{self.counter}", tokens, source.adapter_id, len(tokens) + 4)
        sim.computed = self.m.fork(source.request_id, sim.request_id, shared_len)
        assert sim.computed <= shared_len
        self.forks += 1
        self.running[sim.request_id] = sim

    def end(self, sim: Sim) -> None:
        self.m.free(sim.request_id)
        del self.running[sim.request_id]

    def abort_waiting(self) -> None:
        sim = self.waiting.pop(self.rng.randrange(len(self.waiting)))
        self.m.free(sim.request_id)  # holds nothing: ignored

    def step(self) -> None:
        actions = [self.admit]
        if self.running:
            actions += [self.grow] * 4 + [self.fork, lambda: self.end(self.pick_running())]
        if self.waiting:
            actions.append(self.abort_waiting)
        self.rng.choice(actions)()

    def pick_running(self) -> Sim:
        return self.rng.choice(list(self.running.values()))

    def check(self) -> None:
        check_invariants(self.m)
        assert set(self.m._requests) == set(self.running)
        for sim in self.running.values():
            table = self.m.block_table(sim.request_id)
            assert len(table) >= self.m.num_blocks_for(sim.computed)
            for position in range(sim.computed):  # nobody overwrote this request's KV
                assert self.kv[table[position // BS], position % BS] == self.content(sim, position)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_life_never_leaks_double_frees_or_corrupts_a_block(seed: int) -> None:
    life = RandomLife(seed)
    for _ in range(3000):
        life.step()
        life.check()
    assert life.preemptions > 10 and life.forks > 10
    assert life.m.prefix_hit_tokens > 100
    for request_id in list(life.running):
        life.m.free(request_id)
    assert life.m.num_free_blocks == life.m.num_blocks and life.m.usage == 0.0
    check_invariants(life.m)
