"""Which replica serves a request: the routing policy of a fleet of engine replicas.

Pure code (no Ray, no clock, no I/O): the Ray Serve request router is its adapter, the
fleet simulator (``benchmarks/sim_router.py``) drives it with simulated replicas, and the
unit tests drive it directly.

What a replica caches is what the engine's block manager names: the chained hash of each
full block of a prompt (:func:`domain.kv_blocks.hash_block`, keyed by the request's cache
namespace: LoRA adapter and ``cache_salt``). :func:`prompt_block_hashes` computes the same
chain from the ingress's token ids, so the router knows a request's blocks exactly and only
has to guess where they live. :class:`PrefixIndex` holds that guess: the hashes each
replica was sent recently (a replica keeps the blocks of the prompts it served until its
pool evicts them), bounded by each replica's pool size, least recently routed first out,
and corrected by what replicas report (evictions, a restart).

:class:`Router` picks a replica for a request, by policy:

- ``round-robin``: in turn;
- ``pow2``: the less loaded of two replicas drawn at random (power of two choices);
- ``prefix``: the replica scoring best on ``prefix_weight`` x the fraction of the
  request's blocks it holds + ``queue_weight`` x (1 - its waiting requests over the most
  any replica has waiting) + ``kv_weight`` x (1 - its KV usage) — the weights of llm-d's
  scorers (3 / 2 / 2); as llm-d's queue scorer, the queue is the requests that cannot
  start yet: a request joining a batch with room waits for nothing —, ties to the lighter
  queue (running and waiting); when the fleet is out of balance (the longest queue exceeds the
  shortest by more than ``imbalance`` requests, as Ray's prefix-aware router checks), pow2
  instead, so one hot prefix cannot pile work on one replica.

A request on a LoRA adapter (``adapter``) goes, under ``prefix`` and ``pow2``, to the
replicas that hold it (as each reports, and where calls on it were routed since): the
policy chooses among them while the lightest of them is within ``imbalance`` requests of
the lightest replica, else among all (a replica that does not hold it loads it at the
call); when none holds it, among all.

A request with a ``session`` (a client's sticky key) goes to the replica its session was
pinned to while that replica lives; its first request is routed by the policy and pins it.
A request naming its ``replica`` (a Tinker call: the ids of Tinker's sessions, runs and
futures carry the replica that holds them) goes there while it lives, and by the policy
once it is gone.
"""

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from domain.kv_blocks import BlockHash, hash_block

Policy = Literal["prefix", "pow2", "round-robin"]
POLICIES: tuple[Policy, ...] = ("prefix", "pow2", "round-robin")


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, namespace: str | None = None
) -> tuple[BlockHash, ...]:
    """The chained hashes of the prompt's full blocks, short of its last token (the engine
    never serves that one from cache: it must run for the logits) — what
    :meth:`~domain.kv_blocks.BlockManager.find_cached_prefix` looks up."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent = b""
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return tuple(hashes)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica as the router sees it: its id and its last reported load."""

    replica_id: str
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # of its KV pool, 0..1

    @property
    def queue(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs of a request: its prompt's block-hash chain, its session, the
    replica it must go to while that one lives (``replica``: where its state is, as a
    Tinker session's or future's id names it) and its LoRA adapter's id (None: the base
    model)."""

    block_hashes: tuple[BlockHash, ...] = ()
    session: str | None = None
    replica: str | None = None
    adapter: str | None = None


@dataclass(slots=True)
class _Held:
    hashes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)


class PrefixIndex:
    """Which block hashes each replica probably holds, ``capacity`` blocks each at most
    (the replica's pool): recorded when a request is routed there, least recently routed
    first out, dropped when the replica reports them evicted or restarts."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._held: dict[str, _Held] = {}

    def record(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        held = self._held.setdefault(replica_id, _Held()).hashes
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def matched(self, replica_id: str, hashes: Sequence[BlockHash]) -> int:
        """How many of the chain's leading blocks the replica holds (a chain: a block is
        useful only after its parent)."""
        held = self._held.get(replica_id)
        if held is None:
            return 0
        count = 0
        for h in hashes:
            if h not in held.hashes:
                break
            count += 1
        return count

    def evicted(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        held = self._held.get(replica_id)
        if held is not None:
            for h in hashes:
                held.hashes.pop(h, None)

    def forget(self, replica_id: str) -> None:
        """The replica restarted or left: it holds nothing."""
        self._held.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        held = self._held.get(replica_id)
        return 0 if held is None else len(held.hashes)


def imbalance_for(max_num_seqs: int) -> int:
    """The queue gap past which prefix routing yields to pow2, for replicas running
    ``max_num_seqs`` requests each: half a replica's batch (at least Ray's 10). A tighter
    gap gives up cache affinity under ordinary load (64 running per replica: gaps of 10
    are routine), a looser one lets a hot prefix queue up (benchmarks/README.md)."""
    return max(10, max_num_seqs // 2)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    policy: Policy = "prefix"
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    # queue difference (requests) past which prefix routing yields to pow2 (Ray's default)
    imbalance: int = 10
    index_capacity: int = 8192  # blocks remembered per replica (its pool's size)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if min(self.prefix_weight, self.queue_weight, self.kv_weight) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {self.imbalance}")


@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision and why (for logs, metrics and tests)."""

    replica_id: str
    reason: Literal["owner", "session", "prefix", "pow2", "round-robin"]
    matched_blocks: int = 0


class Router:
    """Picks a replica per request (see the module). ``rng``: the pow2 draws (seeded in
    tests and simulations)."""

    def __init__(self, settings: RouterSettings | None = None, rng: random.Random | None = None):
        self.settings = settings or RouterSettings()
        self.index = PrefixIndex(self.settings.index_capacity)
        self._rng = rng or random.Random()
        self._turn = 0
        self._sessions: dict[str, str] = {}
        # The LoRA adapters each replica holds: its last report, and those routed there since.
        self._adapters: dict[str, set[str]] = {}

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Route:
        """The replica for ``request`` among the live ``replicas`` (not empty); records
        that the chosen one will hold the request's blocks and pins a new session."""
        if not replicas:
            raise ValueError("no live replica to route to")
        live = {r.replica_id: r for r in replicas}
        if request.replica in live:
            replica = request.replica
            route = Route(replica, "owner", self.index.matched(replica, request.block_hashes))
            self._holds(replica, request.adapter)
            return route
        pinned = self._sessions.get(request.session) if request.session is not None else None
        if pinned is not None and pinned in live:
            route = Route(pinned, "session", self.index.matched(pinned, request.block_hashes))
        else:
            route = self._choose(request, self._holding(request.adapter, replicas))
            if request.session is not None:
                self._sessions[request.session] = route.replica_id
        self.index.record(route.replica_id, request.block_hashes)
        self._holds(route.replica_id, request.adapter)
        return route

    def reported_adapters(self, replica_id: str, adapter_ids: Iterable[str]) -> None:
        """The LoRA adapters ``replica_id`` reports holding (what it loaded and has not
        evicted), in place of what the router thought."""
        self._adapters[replica_id] = set(adapter_ids)

    def _holds(self, replica_id: str, adapter: str | None) -> None:
        if adapter is not None:  # the replica loads it for the call, if not already
            self._adapters.setdefault(replica_id, set()).add(adapter)

    def _holding(
        self, adapter: str | None, replicas: Sequence[ReplicaLoad]
    ) -> Sequence[ReplicaLoad]:
        """The replicas the policy chooses among for a call on ``adapter``: those holding
        it while the lightest of them is within ``imbalance`` of the lightest replica, else
        all (see the module)."""
        if adapter is None or self.settings.policy == "round-robin":
            return replicas
        holding = [r for r in replicas if adapter in self._adapters.get(r.replica_id, ())]
        if not holding or len(holding) == len(replicas):
            return replicas
        lightest = min(r.queue for r in replicas)
        if min(r.queue for r in holding) - lightest > self.settings.imbalance:
            return replicas
        return holding

    def replica_gone(self, replica_id: str) -> None:
        """A replica died or restarted: its cache is empty, its sessions move on their next
        request (Tinker's runs on it have failed: the caller says so to their clients)."""
        self.index.forget(replica_id)
        self._adapters.pop(replica_id, None)
        for session in [s for s, r in self._sessions.items() if r == replica_id]:
            del self._sessions[session]

    def end_session(self, session: str) -> None:
        self._sessions.pop(session, None)

    def _choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Route:
        policy = self.settings.policy
        if policy == "round-robin":
            replica = replicas[self._turn % len(replicas)]
            self._turn += 1
            return Route(replica.replica_id, "round-robin")
        queues = [r.queue for r in replicas]
        if policy == "pow2" or max(queues) - min(queues) > self.settings.imbalance:
            return self._pow2(request, replicas)
        return self._by_score(request, replicas)

    def _pow2(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Route:
        if len(replicas) == 1:
            chosen = replicas[0]
        else:
            a, b = self._rng.sample(list(replicas), 2)
            chosen = a if (a.queue, a.kv_usage) <= (b.queue, b.kv_usage) else b
        return Route(
            chosen.replica_id, "pow2", self.index.matched(chosen.replica_id, request.block_hashes)
        )

    def _by_score(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Route:
        s = self.settings
        blocks = len(request.block_hashes)
        longest = max(r.waiting for r in replicas)
        best: tuple[float, int, float] | None = None
        chosen, chosen_matched = replicas[0], 0
        for r in replicas:
            matched = self.index.matched(r.replica_id, request.block_hashes)
            prefix = matched / blocks if blocks else 0.0
            queue = 1.0 - r.waiting / longest if longest else 1.0
            kv = 1.0 - min(max(r.kv_usage, 0.0), 1.0)
            score = s.prefix_weight * prefix + s.queue_weight * queue + s.kv_weight * kv
            key = (score, -r.queue, -r.kv_usage)
            if best is None or key > best:
                best, chosen, chosen_matched = key, r, matched
        return Route(chosen.replica_id, "prefix", chosen_matched)
