"""vLLM's KV cache events on ZeroMQ (``--kv-events-config`` with publisher ``zmq``), as
vLLM's ``ZmqEventPublisher`` sends them: after each engine step that stored or evicted
prefix-cache blocks, one message ``[topic, 8-byte big-endian sequence number, msgpack
batch]`` on a PUB socket, the sequence counting from 0, whose batch is vLLM's
``KVEventBatch`` — ``[ts, [event, ...]]``, each event a tagged array ``["BlockStored",
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`` or
``["BlockRemoved", block_hashes, medium]``, then in a fleet the replica's rank as vLLM's
``data_parallel_rank`` — so a subscriber written for vLLM (llm-d's KV-cache indexer,
Dynamo's relay, vLLM's ``kv_events_subscriber.py``) reads ours unchanged.

The PUB socket binds its endpoint or connects to it (:func:`~domain.kv_events.binds`, vLLM's
rule; a fleet's replica binds a port of its own: :meth:`KVEventsConfig.for_replica`). With a
``replay_endpoint``, a ROUTER socket bound there answers a subscriber that missed batches:
its request is the first sequence number it wants (8 bytes, big-endian, in a REQ socket's
envelope: ``[b"", seq]`` from a DEALER), the reply one message ``[b"", sequence number,
batch]`` per batch still kept (the last ``buffer_steps``) from there on, then ``[b"", -1 as
8 signed bytes, b""]``.

The step observer only queues the batch; a thread of its own sends it and answers the
replays (the engine's thread never waits on the network; a full queue drops the batch,
logged)."""

import queue
import threading
import time
from collections import deque

import msgspec
import structlog
import zmq

from domain.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventsConfig, binds
from domain.observer import StepStats

log = structlog.get_logger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_S = 0.1  # how long a replay request may wait while no batch is sent


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
    data_parallel_rank: int | None = None  # a fleet's replica (left out in one process)


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
    """The ``StepObserver`` that publishes each step's KV events (see the module); ``rank``:
    a fleet's replica's (None: one process)."""

    def __init__(
        self,
        config: KVEventsConfig,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        rank: int | None = None,
    ):
        config = config.for_replica(rank)
        self.endpoint, self.replay_endpoint = config.endpoint, config.replay_endpoint
        self.topic = config.topic.encode()
        self.rank = rank
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.set_hwm(config.hwm)
            if binds(config.endpoint):
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._queue: queue.Queue[bytes | None] = queue.Queue(config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._send_forever, name="kv-events", daemon=True)
        self._thread.start()
        log.info(
            "publishing KV cache events",
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            topic=config.topic,
            rank=rank,
        )

    def on_step(self, stats: StepStats) -> None:
        if not stats.kv_events:
            return
        events = [wire_event(e) for e in stats.kv_events]
        batch = _Batch(time.time(), events, self.rank)  # type: ignore[arg-type]
        payload = self._encoder.encode(batch)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            log.warning("KV events dropped: the sender is behind", events=len(stats.kv_events))

    def _send_forever(self) -> None:
        wait = REPLAY_POLL_S if self._replay is not None else None
        while True:
            self._answer_replays()
            try:
                payload = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq, self._seq = self._seq, self._seq + 1
            if self._replay is not None:  # kept even if not sent: a replay may give it
                self._buffer.append((seq, payload))
            try:
                self._socket.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                log.warning("KV events not sent", error=str(e))

    def _answer_replays(self) -> None:
        """Answer the replay requests waiting (vLLM's replay: see the module)."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            try:
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("KV events replay request ignored", frames=len(frames))
                    continue
                client, empty, first = frames
                start = int.from_bytes(first, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
                replay.send_multipart((client, empty, END_OF_REPLAY, b""))
            except zmq.ZMQError as e:
                log.warning("KV events replay failed", error=str(e))

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
