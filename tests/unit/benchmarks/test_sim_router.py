"""benchmarks/sim_router.py: the simulated fleet runs the real routing policy, finishes
every request, reproduces itself from its seed, and shows the cache effect it measures."""

import argparse

from tests.bench_modules import load_benchmark

sim = load_benchmark("sim_router")


def _args(**overrides: object) -> argparse.Namespace:
    base = dict(
        seconds=8.0,
        load=0.6,
        seed=3,
        session_share=0.1,
        system_prompts=1.0,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=16,
        kv_blocks=512,
        step_ms=11.0,
        row_ms=1.6,
        token_ms=1.2,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


def test_every_policy_finishes_every_request_and_prefix_caches_most() -> None:
    args = _args()
    requests = sim.trace(args, 4, 4.0)
    assert requests and all(r.arrival < args.seconds for r in requests)
    results = {p: sim.simulate(args, p, 4, requests) for p in ("prefix", "pow2", "round-robin")}
    assert all(r["finished"] == 1.0 for r in results.values())
    assert all(0.0 <= r["cached"] < 1.0 and r["imbalance"] >= 1.0 for r in results.values())
    assert results["prefix"]["cached"] > results["pow2"]["cached"]
    assert results["prefix"]["cached"] > results["round-robin"]["cached"]
    assert sim.simulate(args, "pow2", 4, requests) == results["pow2"]  # seeded: reproducible


def test_a_replica_never_holds_more_blocks_than_its_pool() -> None:
    args = _args(kv_blocks=200)
    router = sim.Router(sim.RouterSettings(policy="prefix", index_capacity=200))
    replica = sim.Replica("r0", args, sim.Curve(0.01, 0.001, 0.001), router)
    now = 0.0
    for r in sim.trace(args, 1, 3.0)[:40]:
        r.hashes = sim.prompt_block_hashes(r.prompt, args.block_size)
        replica.waiting.append(r)
        now = replica.step(now)
        assert len(replica.held) + len(replica.free_cached) <= args.kv_blocks
    for _ in range(100_000):
        if not (replica.running or replica.waiting):
            break
        now = replica.step(now)
        assert len(replica.held) + len(replica.free_cached) <= args.kv_blocks
    assert not replica.held  # every block released
