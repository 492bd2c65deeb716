"""Issue 47 on a real fleet (two replicas on a local Ray cluster, ``--routing pow2``):
each replica publishes its own KV cache events to the one subscriber its PUB connects to,
named by Ray Serve's rank as vLLM's ``data_parallel_rank``, and keeps them for replay on a
port of its own (the replay endpoint's port + its rank); ``/v1/load_lora_adapter`` at the
ingress refuses a folder a replica could not load (a rank over ``--max-lora-rank``) at the
load, and the calls on a loaded adapter stay on the replica that holds it (pow2 alone would
spread them)."""

import json
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from adapters.weights.resolve import resolve_model
from tests.e2e.server import free_port
from tests.support import ray_cluster as fleets
from tests.support.kv_events import KVEventBatch, received, replayed, settle
from tests.support.peft_adapters import random_adapter

pytestmark = pytest.mark.slow


def test_a_fleets_replicas_publish_kv_events_and_keep_an_adapters_calls(tmp_path: Path) -> None:
    assert not fleets.ray_processes(), "a Ray cluster is already running here"
    model = resolve_model(None, progress=False).path
    good = random_adapter(tmp_path / "good", model, rank=4)
    wide = random_adapter(tmp_path / "wide", model, rank=16)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    replay_port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv@fleet@smollm2",
    }
    log = tmp_path / "serve.log"
    url, process = fleets.start_fleet(
        log,
        *("--replicas", "2", "--threads", "1", "--routing", "pow2", "--usage-db", ":memory:"),
        *("--enable-lora", "--max-lora-rank", "8", "--kv-events-config", json.dumps(events)),
    )
    replays = [context.socket(zmq.DEALER) for _ in range(2)]
    try:
        fleets.wait_for_replicas(url, process, log, 2)
        assert sorted(r["rank"] for r in fleets.running_replicas(url)) == [0, 1]
        settle(sub, wait_s=2.0)  # the replicas' PUB sockets have connected to it

        def call(i: int, model: str | None = None) -> str:
            body = {"prompt": f"{i}: " + "the weather today " * 4, "max_tokens": 2}
            reply = httpx.post(
                f"{url}/v1/completions",
                json={**body, **({"model": model} if model else {})},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            return reply.headers["x-infer-replica"]

        served = {call(i) for i in range(10)}
        assert len(served) == 2, served  # pow2 spread them
        batches = received(sub)
        assert {b.data_parallel_rank for _, _, b in batches} == {0, 1}
        assert {t for t, _, _ in batches} == {b"kv@fleet@smollm2"}
        for rank, replay in enumerate(replays):
            replay.connect(f"tcp://127.0.0.1:{replay_port + rank}")
            kept = replayed(replay, 0)
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            assert kept and {decoder.decode(p).data_parallel_rank for _, p in kept} == {rank}

        load = f"{url}/v1/load_lora_adapter"
        refused = httpx.post(load, json={"lora_name": "wide", "lora_path": str(wide)}, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "lora_path" and "rank 16 is over" in error["message"]
        loaded = httpx.post(load, json={"lora_name": "good", "lora_path": str(good)}, timeout=30)
        assert loaded.status_code == 200, loaded.text
        on_adapter = [call(100 + i, "good") for i in range(6)]
        assert len(set(on_adapter)) == 1, on_adapter  # where the adapter is
    finally:
        for socket_ in (sub, *replays):
            socket_.close(linger=0)
        left = fleets.stop_fleet(process)
    assert not left
