"""vLLM's KV cache events on a ZeroMQ PUB socket (``--kv-events-config`` with publisher
``zmq``): after each engine step that stored or evicted prefix-cache blocks, one message
``[topic, 8-byte big-endian sequence number, msgpack batch]`` whose batch is vLLM's
``KVEventBatch`` — ``[ts, [event, ...]]``, each event a tagged array ``["BlockStored",
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`` or
``["BlockRemoved", block_hashes, medium]`` — so a subscriber written for vLLM (llm-d's
KV-cache indexer, Dynamo's relay, vLLM's ``kv_events_subscriber.py``) reads ours unchanged.

The step observer only queues the batch; a thread of its own sends it (the engine's thread
never waits on the network; a full queue drops the oldest batch, logged)."""

import queue
import threading
import time

import msgspec
import structlog
import zmq

from domain.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventsConfig
from domain.observer import StepStats

log = structlog.get_logger(__name__)
MAX_QUEUED = 4096  # batches waiting for the sender


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]


MEDIUM = "CPU"  # where the blocks live (vLLM says GPU for its device cache)


def wire_event(event: KVEvent) -> _Event:
    if isinstance(event, BlockStored):
        return _BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            MEDIUM,
        )
    if isinstance(event, BlockRemoved):
        return _BlockRemoved(list(event.block_hashes), MEDIUM)
    return _AllBlocksCleared()


class ZmqKVEventPublisher:
    """The ``StepObserver`` that publishes each step's KV events (see the module)."""

    def __init__(
        self, config: KVEventsConfig, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ):
        self.topic = config.topic.encode()
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._queue: queue.Queue[bytes | None] = queue.Queue(MAX_QUEUED)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._send_forever, name="kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV cache events", endpoint=config.endpoint, topic=config.topic)

    def on_step(self, stats: StepStats) -> None:
        if not stats.kv_events:
            return
        batch = _Batch(time.time(), [wire_event(e) for e in stats.kv_events])  # type: ignore[misc]
        payload = self._encoder.encode(batch)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            log.warning("KV events dropped: the sender is behind", events=len(stats.kv_events))

    def _send_forever(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            self._seq += 1
            try:
                self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                log.warning("KV events not sent", error=str(e))

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
