"""vLLM's KV cache events (``--kv-events-config``) read by a ZeroMQ subscriber written as
vLLM's own example is (its msgspec types): blocks stored as requests' prompts fill them
(chained hashes, the tokens, the block size), removed when the pool evicts them; the
sequence numbers count up from 0; nothing is published without the flag. The PUB socket
binds a wildcard endpoint and connects to any other (vLLM's rule: llm-d's indexer binds);
the replay socket gives back the batches kept from a sequence number on; a fleet's replicas
each publish their own, named by ``data_parallel_rank``, on ports of their own when bound."""

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from domain.kv_events import KVEventsConfig
from entrypoints.config import ServerConfig, to_json
from entrypoints.container import create_container
from entrypoints.replicas import replica_container
from tests.fakes import fake_container
from tests.support.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    free_port,
    received,
    replayed,
    settle,
)


def test_stored_and_evicted_blocks_reach_a_vllm_subscriber(tmp_path) -> None:
    port = free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv"
    )
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
    # 8 blocks of 16 positions: the second prompt evicts the first's cached blocks.
    container = fake_container(
        runner,
        cache_dir=str(tmp_path),
        kv_events_config=config,
        num_kv_blocks=8,
        max_model_len=128,
        max_num_seqs=1,
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")  # the wildcard endpoint: the publisher binds
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    with TestClient(app=container.http_app()) as http:
        time.sleep(0.3)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
        first = "a" * 70  # 4 full blocks of 16 tokens (BOS and a byte per character)
        body = {"model": "fake", "prompt": first, "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        stored_batches = received(sub)
        body = {"model": "fake", "prompt": "b" * 100, "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        later = received(sub)
    sub.close(linger=0)
    events = [e for _, _, batch in stored_batches for e in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 4, events
    assert all(t == b"kv" for t, _, _ in stored_batches)
    assert stored[0].parent_block_hash is None  # the first block of a prompt
    for parent, child in itertools.pairwise(stored):
        assert child.parent_block_hash == parent.block_hashes[0]  # the chain
    assert all(len(e.token_ids) == 16 and e.block_size == 16 for e in stored)
    assert stored[0].token_ids == list(ByteTokenizer().encode(first))[:16]
    assert all(
        isinstance(e.block_hashes[0], bytes) and len(e.block_hashes[0]) == 32 for e in stored
    )
    removed = [
        h
        for _, _, b in later
        for e in b.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    assert set(removed) & {e.block_hashes[0] for e in stored}  # the pool evicted the first's
    seqs = [seq for _, seq, _ in stored_batches + later]
    assert seqs == list(range(len(seqs)))  # from 0, as vLLM counts
    assert all(b.data_parallel_rank is None for _, _, b in stored_batches)  # one process


def events_config(endpoint: str, **fields: Any) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv", **fields
    )


def completion(http: TestClient[Any], prompt: str) -> None:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_a_connect_endpoint_reaches_a_binding_subscriber_and_missed_batches_replay(
    tmp_path,
) -> None:
    """llm-d's way: the indexer binds its SUB, the server's PUB connects to it; a subscriber
    that missed batches asks the replay socket for them by sequence number."""
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    replay_port = free_port()
    config = events_config(
        f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    container = fake_container(
        cache_dir=str(tmp_path), kv_events_config=config, num_kv_blocks=8, max_model_len=128
    )
    replay = context.socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        with TestClient(app=container.http_app()) as http:
            settle(sub)  # the publisher's connection and the subscription
            completion(http, "a" * 70)
            completion(http, "b" * 100)
            live = received(sub)
            assert [seq for _, seq, _ in live] == list(range(len(live))) and len(live) >= 2
            everything = replayed(replay, 0)
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            assert [(seq, decoder.decode(p)) for seq, p in everything] == [
                (seq, batch) for _, seq, batch in live
            ]
            assert replayed(replay, 1) == everything[1:]
            assert replayed(replay, len(live)) == []  # nothing past the newest
    finally:
        sub.close(linger=0)
        replay.close(linger=0)


def test_a_fleets_replicas_publish_their_own_events(tmp_path) -> None:
    """Each replica's container (as the fleet builds it: its rank) publishes its own
    events, named by ``data_parallel_rank``: connected, every replica to the one subscriber;
    bound, each on the port + its rank (replay sockets too). The ingress publishes none."""
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    connected = events_config(f"tcp://127.0.0.1:{port}")
    try:
        with fleet(connected, tmp_path) as (first, second):
            settle(sub)
            completion(first, "a" * 40)
            completion(second, "b" * 40)
            got = received(sub)
        assert {b.data_parallel_rank for _, _, b in got} == {0, 1}
        assert {t for t, _, _ in got} == {b"kv"}
    finally:
        sub.close(linger=0)
    base, replay_base = free_port(), free_port()
    while abs(base - replay_base) < 2:  # each binds two ports: apart
        replay_base = free_port()
    bound = events_config(f"tcp://*:{base}", replay_endpoint=f"tcp://*:{replay_base}")
    subs = [context.socket(zmq.SUB) for _ in range(2)]
    replays = [context.socket(zmq.DEALER) for _ in range(2)]
    try:
        for rank in (0, 1):
            subs[rank].connect(f"tcp://127.0.0.1:{base + rank}")
            subs[rank].setsockopt(zmq.SUBSCRIBE, b"kv")
            replays[rank].connect(f"tcp://127.0.0.1:{replay_base + rank}")
        with fleet(bound, tmp_path) as (first, second):
            settle(*subs)
            completion(first, "a" * 40)
            completion(second, "b" * 40)
            by_port = [received(s) for s in subs]
            for rank, batches in enumerate(by_port):
                assert batches and {b.data_parallel_rank for _, _, b in batches} == {rank}
                kept = [seq for seq, _ in replayed(replays[rank], 0)]
                assert kept == [seq for _, seq, _ in batches]
    finally:
        for socket_ in (*subs, *replays):
            socket_.close(linger=0)
    ingress = create_container(ServerConfig.for_model(replicas=2, kv_events_config=bound))
    assert ingress.kv_events() is None


@contextlib.contextmanager
def fleet(
    events: KVEventsConfig, tmp_path: Path
) -> Iterator[tuple[TestClient[Any], TestClient[Any]]]:
    """Two replicas' containers, built as the fleet builds them (no Ray: their apps)."""
    config = ServerConfig.for_model(
        runner="fake", replicas=2, kv_events_config=events, cache_dir=str(tmp_path)
    )
    containers = [replica_container(to_json(config), f"r{rank}", rank) for rank in (0, 1)]
    with (
        TestClient(app=containers[0].http_app()) as first,
        TestClient(app=containers[1].http_app()) as second,
    ):
        time.sleep(0.3)  # the connections and the subscriptions settle
        yield first, second


def test_without_the_flag_nothing_is_recorded(tmp_path) -> None:
    container = fake_container(cache_dir=str(tmp_path))
    assert container.kv_events() is None
    engine = container.async_engine()
    assert engine.engine.scheduler.take_kv_events() == []
