"""The fleet's routing policy (:class:`domain.routing.Router`) as a Ray Serve request router.

Ray Serve asks a deployment handle's ``RequestRouter`` which replicas may take a call
(``choose_replicas``: ranks of replicas, best first; Ray sends to the first of a rank that
has room under ``max_ongoing_requests``). This one reads the call's
:class:`~domain.routing.RouteRequest` (the first argument of every engine call: its
prompt's block-hash chain and its session) and the replicas to avoid (the third: those that
lost a try of it), builds each candidate's :class:`~domain.routing.ReplicaLoad` from what
Ray knows (its ongoing calls), what the replica reports every
``request_routing_stats_period_s`` (``record_routing_stats``: running, waiting, KV usage)
and the calls chosen for it but not yet sent (a burst's calls see each other); each
report's evicted block hashes leave what the router thinks the replica holds, and its
LoRA adapters (those loaded and not evicted) replace those the router thought it held;
and ranks the policy's choice first, the rest after it — except where the call's state or
cache is (a Tinker call's replica, a session's, a matched prefix): there it ranks that
replica alone, so a slow answer to Ray's queue probe (a replica busy with a step answers
it late) makes Ray ask again rather than send the call elsewhere.

A replica that dies or leaves is forgotten (its cache with it; its sessions move on their
next call). Configured through ``RequestRouterConfig(request_router_class=...,
request_router_kwargs={"policy": ..., "imbalance": ..., "capacity": ...})``.
"""

from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from domain.routing import ReplicaLoad, Route, Router, RouteRequest, RouterSettings


def replica_key(replica_id: ReplicaID) -> str:
    """A replica's id as the fleet names it (``x-infer-replica``, ``/admin/replicas``)."""
    return str(replica_id.unique_id)


def call_route(request: PendingRequest | None) -> tuple[RouteRequest, frozenset[str]]:
    """What the engine call asks of routing: its route and the replicas to avoid."""
    args: Sequence[Any] = request.args if request is not None else ()
    route = args[0] if args and isinstance(args[0], RouteRequest) else RouteRequest()
    avoid = args[2] if len(args) > 2 and isinstance(args[2], frozenset) else frozenset()
    return route, avoid


class FleetRequestRouter(RequestRouter):
    """Ray Serve's ``RequestRouter`` over :class:`Router` (see the module)."""

    def initialize_state(self, capacity: int = 1 << 30, **kwargs: Any) -> None:
        """``capacity``: the requests a replica runs at once (``--max-num-seqs``); the
        others are RouterSettings'."""
        self.policy = Router(RouterSettings(**kwargs))
        self.capacity = capacity
        self.last_route: Route | None = None
        # Calls chosen for a replica and not yet sent (a burst's calls see each other).
        self._routed: dict[str, int] = {}
        self._report: dict[str, Any] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route, avoid = call_route(pending_request)
        live = [r for r in candidate_replicas if replica_key(r.replica_id) not in avoid]
        live = live or candidate_replicas
        by_key = {replica_key(r.replica_id): r for r in live}
        self.last_route = self.policy.route(route, [self._load(r) for r in live])
        decided = self.last_route
        self._routed[decided.replica_id] = self._routed.get(decided.replica_id, 0) + 1
        chosen = by_key[decided.replica_id]
        if decided.reason in ("owner", "session") or decided.matched_blocks:
            # Where its state or cache is: wait for that replica (Ray probes it again,
            # with a longer deadline) rather than fall to another when a probe is slow.
            return [[chosen]]
        return [[chosen], [r for r in live if r is not chosen]]

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        key = replica_key(replica.replica_id)
        stats = replica.routing_stats or {}
        if stats.get("report") != self._report.get(key):  # a new report counts them
            self._report[key] = stats.get("report")
            self._routed[key] = 0
            self.policy.index.evicted(key, stats.get("evicted", ()))
            self.policy.reported_adapters(key, stats.get("adapters", ()))
        # In flight: the last report's, or Ray's count of ongoing calls where higher (it is
        # fresher), and the calls chosen for it not yet sent; those past a batch wait.
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        ongoing = self.replica_queue_len_cache.get(replica.replica_id) or 0
        in_flight = max(reported, ongoing) + self._routed.get(key, 0)
        waiting = max(int(stats.get("waiting", 0)), in_flight - self.capacity)
        running = max(0, in_flight - waiting)
        return ReplicaLoad(key, running, waiting, float(stats.get("kv_usage", 0.0)))

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)  # Ray's ongoing count has it now
        key = replica_key(replica_id)
        if self._routed.get(key):
            self._routed[key] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.replica_gone(replica_key(replica_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {replica_key(r) for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {replica_key(r) for r in self.curr_replicas}:
            self.policy.replica_gone(gone)
