"""A subscriber of vLLM's KV cache events as vLLM's ``kv_events_subscriber.py`` writes one:
vLLM's msgspec types (``vllm.distributed.kv_events``, ``data_parallel_rank`` included), the
live batches a SUB socket receives, the batches a replay socket gives back."""

import socket
import time
from typing import Any

import msgspec
import zmq


# --- vLLM's types (vllm.distributed.kv_events), as its kv_events_subscriber.py copies them --
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


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


def settle(*subs: zmq.Socket[bytes], wait_s: float = 1.0) -> None:
    """Let publishers' connections and the subscriptions settle (ZeroMQ's slow joiner): a
    bound SUB socket attaches a connecting PUB, and sends it its subscriptions, only while
    it is used, so it is polled here rather than left idle."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for sub in subs:
            sub.poll(10, zmq.POLLOUT)


def received(sub: zmq.Socket[bytes], wait_s: float = 2.0) -> list[tuple[bytes, int, KVEventBatch]]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def replayed(replay: zmq.Socket[bytes], start: int) -> list[tuple[int, bytes]]:
    """What the publisher's replay socket sends back from ``start`` on, up to its end mark
    (asked from a DEALER socket, as a REQ socket's envelope: a REQ one takes one reply)."""
    replay.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while True:
        assert replay.poll(2000), "no end of replay"
        empty, seq, payload = replay.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            return got
        got.append((int.from_bytes(seq, "big"), payload))
