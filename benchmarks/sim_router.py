"""The fleet router at scale, simulated: the real routing policy (``domain/routing.py``)
drives N simulated engine replicas through a trace of shared system prompts, multi-turn
chats and sticky sessions; each policy sees the same trace.

Two replicas on two cores show correctness, not scaling, so the router is measured here,
where it matters. A replica is modeled as the engine schedules (continuous batching,
``max_num_seqs`` running, prompt chunks within ``max_num_batched_tokens`` a step, a paged
KV pool of ``kv_blocks`` blocks of ``block_size`` tokens with prefix caching: a prompt's
leading blocks already in the pool, held or free, are not computed again; freed blocks keep
their content until evicted, least recently freed first), and a step takes
``step_ms + row_ms x decode rows + token_ms x prompt tokens`` — the engine's measured
step-time curve (defaults: the default model on this repository's 2-vCPU Intel Xeon,
benchmarks/README.md; any curve may be given). The router sees each replica's load as the
replicas report it (running, waiting, KV usage) and each eviction (its routing stats).

Reported per policy: the cached fraction of prompt tokens, TTFT p50 / p99, and load
imbalance (the busiest replica's computed tokens over the mean). Usage:

    .venv/bin/python benchmarks/sim_router.py [--replicas 8,64,256] [--seconds 60]
        [--load 0.7] [--seed 0] [--policies prefix,pow2,round-robin]
"""

import argparse
import heapq
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from domain.routing import (
    POLICIES,
    ReplicaLoad,
    Router,
    RouteRequest,
    RouterSettings,
    imbalance_for,
    prompt_block_hashes,
)


@dataclass(frozen=True)
class Curve:
    """A step's time in seconds: ``step + row x decode rows + token x prompt tokens``."""

    step: float
    row: float
    token: float

    def time(self, rows: int, tokens: int) -> float:
        return self.step + self.row * rows + self.token * tokens


@dataclass
class SimRequest:
    arrival: float
    prompt: list[int]
    output: int
    session: str | None
    reply: list[int] = field(default_factory=list)  # its output tokens (the next turn's)
    hashes: tuple[bytes, ...] = ()
    # filled in by the replica
    cached: int = 0  # prompt tokens found in the pool
    prefilled: int = 0
    generated: int = 0
    first_token: float | None = None
    blocks: list[bytes | int] = field(default_factory=list)


class Replica:
    """One engine replica as the engine schedules (see the module)."""

    def __init__(self, name: str, args: argparse.Namespace, curve: Curve, router: Router):
        self.name, self.curve, self.router = name, curve, router
        self.max_seqs, self.budget = args.max_num_seqs, args.max_num_batched_tokens
        self.block, self.capacity = args.block_size, args.kv_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.held: dict[bytes | int, int] = {}  # block -> references (running requests)
        self.free_cached: OrderedDict[bytes, None] = OrderedDict()  # freed, content kept
        self.busy_until = 0.0
        self.computed = 0  # prompt + output tokens computed
        self._anon = 0

    def load(self) -> ReplicaLoad:
        usage = len(self.held) / self.capacity
        return ReplicaLoad(self.name, len(self.running), len(self.waiting), usage)

    def _blocks_in_use(self) -> int:
        return len(self.held) + len(self.free_cached)

    def _admit(self, req: SimRequest) -> bool:
        """Take the request's blocks (its cached prefix shared), or False: pool full."""
        matched = 0
        for h in req.hashes:
            if h not in self.held and h not in self.free_cached:
                break
            matched += 1
        total = -(-(len(req.prompt) + req.output) // self.block)
        fresh = total - matched
        revived = sum(1 for h in req.hashes[:matched] if h in self.free_cached)
        if self.capacity - len(self.held) - revived < fresh:  # free blocks, cached ones too
            return False
        for h in req.hashes[:matched]:
            self.free_cached.pop(h, None)
            self.held[h] = self.held.get(h, 0) + 1
            req.blocks.append(h)
        names: list[bytes | int] = list(req.hashes[matched:])
        while len(names) < fresh:
            self._anon += 1
            names.append(self._anon)  # output blocks: never shared
        evicted: list[bytes] = []
        for name in names[:fresh]:
            if self._blocks_in_use() >= self.capacity:
                old, _ = self.free_cached.popitem(last=False)
                evicted.append(old)
            if isinstance(name, bytes) and name in self.free_cached:
                self.free_cached.pop(name)
            self.held[name] = self.held.get(name, 0) + 1
            req.blocks.append(name)
        if evicted:
            self.router.index.evicted(self.name, evicted)
        req.cached = matched * self.block
        req.prefilled = req.cached
        return True

    def _release(self, req: SimRequest) -> None:
        """Free the request's blocks; the full ones of prompt + output keep their content
        under their chained hashes (the engine names a block once its KV is computed)."""
        for name in req.blocks:
            self.held[name] -= 1
            if self.held[name] == 0:
                del self.held[name]
        reply = req.reply[: req.output] or [0] * req.output
        chain = prompt_block_hashes([*req.prompt, *reply, 0], self.block)
        for h in chain[: len(req.blocks)]:
            if h not in self.held:
                self.free_cached[h] = None
                self.free_cached.move_to_end(h)
        while self._blocks_in_use() > self.capacity:
            self.free_cached.popitem(last=False)

    def step(self, now: float) -> float:
        """Run one step from ``now``; returns its end (``now`` when idle)."""
        while self.waiting and len(self.running) < self.max_seqs:
            if not self._admit(self.waiting[0]):
                break
            self.running.append(self.waiting.popleft())
        if not self.running:
            return now
        budget, tokens, rows = self.budget, 0, 0
        for req in self.running:
            if req.prefilled < len(req.prompt):
                chunk = min(len(req.prompt) - req.prefilled, budget)
                req.prefilled += chunk
                budget -= chunk
                tokens += chunk
            else:
                rows += 1
        end = now + self.curve.time(rows, tokens)
        self.computed += rows + tokens
        still: list[SimRequest] = []
        for req in self.running:
            if req.prefilled < len(req.prompt):
                still.append(req)
                continue
            if req.first_token is None:
                req.first_token = end
            req.generated += 1
            if req.generated >= req.output:
                self._release(req)
            else:
                still.append(req)
        self.running = still
        return end


def trace(args: argparse.Namespace, replicas: int, rate: float) -> list[SimRequest]:
    """Chats over shared system prompts (a Zipf choice among ``--system-prompts`` per
    replica, 8 at least),
    2-6 turns each (a turn's prompt is the whole conversation so far), and a share of
    sticky sessions (Tinker sampling runs: one session key per run)."""
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(1000, 50000) for _ in range(rng.randint(512, 1024))]
        for _ in range(max(8, round(args.system_prompts * replicas)))
    ]
    weights = [1 / (i + 1) for i in range(len(systems))]
    out: list[SimRequest] = []
    t = 0.0
    while t < args.seconds:
        t += rng.expovariate(rate)
        system = rng.choices(systems, weights)[0]
        if rng.random() < args.session_share:  # a sampling run: a few calls, one session
            session = f"run-{len(out)}"
            prompt = [*system, *(rng.randrange(1000, 50000) for _ in range(64))]
            start = t
            for _ in range(rng.randint(2, 5)):
                out.append(SimRequest(start, prompt, rng.randint(32, 128), session))
                start += rng.expovariate(1 / 2.0)
            continue
        history = list(system)
        start = t
        for _ in range(rng.randint(2, 6)):
            history += [rng.randrange(1000, 50000) for _ in range(rng.randint(32, 160))]
            output = rng.randint(32, 160)
            reply = [rng.randrange(1000, 50000) for _ in range(output)]
            out.append(SimRequest(start, list(history), output, None, reply))
            history += reply
            start += output * 0.05 + rng.expovariate(1 / 5.0)  # reply time + user think time
    out.sort(key=lambda r: r.arrival)
    return [r for r in out if r.arrival < args.seconds]


def simulate(args: argparse.Namespace, policy: str, replicas: int, requests: list[SimRequest]):
    curve = Curve(args.step_ms / 1e3, args.row_ms / 1e3, args.token_ms / 1e3)
    router = Router(
        RouterSettings(
            policy=policy,  # type: ignore[arg-type]
            index_capacity=args.kv_blocks,
            imbalance=imbalance_for(args.max_num_seqs),
        ),
        random.Random(args.seed),
    )
    fleet = [Replica(f"r{i}", args, curve, router) for i in range(replicas)]
    reqs = [
        SimRequest(
            r.arrival,
            r.prompt,
            r.output,
            r.session,
            r.reply,
            prompt_block_hashes(r.prompt, args.block_size),
        )
        for r in requests
    ]
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = arrival / 1 = step end, index)
    for i, r in enumerate(reqs):
        heapq.heappush(events, (r.arrival, 0, i))
    stepping = [False] * replicas
    while events:
        now, kind, i = heapq.heappop(events)
        if kind == 0:
            req = reqs[i]
            route = router.route(RouteRequest(req.hashes, req.session), [f.load() for f in fleet])
            j = int(route.replica_id[1:])
            fleet[j].waiting.append(req)
        else:
            j = i
            stepping[j] = False
        if not stepping[j]:
            end = fleet[j].step(now)
            if end > now:
                stepping[j] = True
                heapq.heappush(events, (end, 1, j))
    ttft = sorted(r.first_token - r.arrival for r in reqs if r.first_token is not None)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    computed = [f.computed for f in fleet]
    return {
        "cached": sum(r.cached for r in reqs) / prompt_tokens,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "imbalance": max(computed) / statistics.mean(computed),
        "finished": len(ttft) / len(reqs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--replicas", default="8,64,256")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seconds", type=float, default=60.0, help="simulated arrival window")
    p.add_argument("--load", type=float, default=0.7, help="offered load, of fleet capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--session-share", type=float, default=0.1)
    p.add_argument(
        "--system-prompts", type=float, default=0.25, help="distinct system prompts a replica"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=2048, help="per replica")
    p.add_argument("--step-ms", type=float, default=11.0)
    p.add_argument("--row-ms", type=float, default=1.6)
    p.add_argument("--token-ms", type=float, default=1.2)
    args = p.parse_args()
    print("# sim_router\n")
    print(
        f"curve: step {args.step_ms} ms + {args.row_ms} ms a decode row + {args.token_ms} ms a "
        f"prompt token; max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens} prompt "
        f"tokens a step, {args.kv_blocks} KV blocks of {args.block_size} a replica; load "
        f"{args.load}, {args.seconds:g} s of arrivals, {args.system_prompts:g} system prompts "
        f"a replica, {args.session_share:.0%} of arrivals sticky sessions, seed {args.seed}\n"
    )
    print(
        "| replicas | policy | requests | cached prompt tokens | TTFT p50 s | TTFT p99 s | "
        "imbalance (max / mean) | sim s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.replicas.split(",")]:
        # the arrival rate for the offered load: a replica's time for a request with nothing
        # cached (its prompt tokens, its output tokens as rows of a 16-row batch)
        sample = trace(args, n, n)
        cost = statistics.mean(
            args.token_ms * len(r.prompt) + (args.row_ms + args.step_ms / 16) * r.output
            for r in sample
        )
        requests = trace(args, n, args.load * n / (cost / 1e3))
        for policy in args.policies.split(","):
            start = time.perf_counter()
            r = simulate(args, policy, n, requests)
            print(
                f"| {n} | {policy} | {len(requests)} | {r['cached']:.1%} | {r['ttft_p50']:.2f} | "
                f"{r['ttft_p99']:.2f} | {r['imbalance']:.2f} | {time.perf_counter() - start:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
