"""vLLM's KV cache events (``--kv-events-config``) read by a ZeroMQ subscriber written as
vLLM's own example is (its msgspec types): blocks stored as requests' prompts fill them
(chained hashes, the tokens, the block size), removed when the pool evicts them; the
sequence numbers count up; nothing is published without the flag."""

import itertools
import socket
import time
from typing import Any

import msgspec
import zmq
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from domain.kv_events import KVEventsConfig
from tests.fakes import fake_container


# --- vLLM's types (vllm.distributed.kv_events), as its kv_events_subscriber.py copies them --
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def received(sub: zmq.Socket[bytes], wait_s: float = 2.0) -> list[tuple[bytes, int, KVEventBatch]]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def test_stored_and_evicted_blocks_reach_a_vllm_subscriber(tmp_path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
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
    sub.connect(endpoint)
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
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_without_the_flag_nothing_is_recorded(tmp_path) -> None:
    container = fake_container(cache_dir=str(tmp_path))
    assert container.kv_events() is None
    engine = container.async_engine()
    assert engine.engine.scheduler.take_kv_events() == []
