"""KV cache events, vLLM's (``vllm.distributed.kv_events``): the prefix cache's blocks as
they are stored (a full block's KV computed and named by its chained hash) and removed
(evicted), which a KV-aware router (llm-d's, Dynamo's, vLLM's own) follows to know what each
replica holds. Published after each engine step (``--kv-events-config``; off by default).
"""

import zlib
from dataclasses import dataclass, replace

from domain.errors import InvalidParameterError

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields: ``enable_kv_cache_events`` records the events;
    ``publisher`` ``zmq`` sends them (``null``: recorded, sent nowhere) on a ZeroMQ PUB socket
    at ``endpoint`` (bound or connected: :func:`binds`), each message ``[topic, sequence
    number, msgpack batch]``, at most ``hwm`` messages queued per subscriber (ZeroMQ's
    high-water mark; past it a slow subscriber misses batches) and ``max_queue_size`` batches
    waiting for the sender thread; with ``replay_endpoint``, a ROUTER socket bound there
    sends back the last ``buffer_steps`` batches from a sequence number a subscriber asks
    for (vLLM's replay). vLLM's defaults, but ``max_queue_size``: ours (a full queue drops
    the newest batch, where vLLM's engine would wait)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 4096
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise InvalidParameterError(
                "kv_events_config", f"publisher must be one of {', '.join(PUBLISHERS)}"
            )
        if min(self.buffer_steps, self.hwm) < 0 or self.max_queue_size < 1:
            raise InvalidParameterError(
                "kv_events_config", "buffer_steps and hwm must be >= 0, max_queue_size >= 1"
            )

    @property
    def recording(self) -> bool:
        return self.enable_kv_cache_events

    def for_replica(self, rank: int | None) -> "KVEventsConfig":
        """This configuration as the fleet's replica of ``rank`` publishes it (None: one
        process, as given): a bound endpoint on a port of its own, the given port + ``rank``
        (vLLM's rule for its data-parallel ranks), and so the replay endpoint (always bound);
        a connected endpoint as given: every replica connects to the one subscriber that
        binds it (llm-d's indexer). ``InvalidParameterError`` naming ``kv_events_config``
        when a bound TCP endpoint has no port number."""
        if not rank:
            return self
        endpoint = self.endpoint
        if binds(endpoint):
            endpoint = _offset(endpoint, rank, "endpoint")
        replay = self.replay_endpoint
        if replay is not None:
            replay = _offset(replay, rank, "replay_endpoint")
        return replace(self, endpoint=endpoint, replay_endpoint=replay)

    def check_fleet(self, replicas: int) -> None:
        """``InvalidParameterError`` naming ``kv_events_config`` unless ``replicas`` replicas
        (ranks 0 to ``replicas`` - 1) can each publish: an ``inproc://`` endpoint (reached
        from its own process only) refused, every bound TCP endpoint with a port, the bound
        ports of the endpoint and the replay endpoint apart (``tcp://*:5557`` and
        ``tcp://*:5558`` would meet at 2 replicas)."""
        if self.publisher != "zmq" or not self.recording:
            return
        sockets = [("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)]
        bound = [(n, e) for n, e in sockets if e is not None and (n != "endpoint" or binds(e))]
        for name, endpoint in bound:
            if endpoint.startswith("inproc://"):
                raise InvalidParameterError(
                    "kv_events_config",
                    f"{name} {endpoint!r}: inproc:// is not reached from another process: "
                    "not with --replicas",
                )
        if replicas < 2:
            return
        last = self.for_replica(replicas - 1)
        tcp = [
            (_port(endpoint), _port(getattr(last, name)))
            for name, endpoint in bound
            if endpoint.startswith("tcp://")
        ]
        if len(tcp) == 2 and tcp[0][0] <= tcp[1][1] and tcp[1][0] <= tcp[0][1]:
            (a, b), (c, d) = tcp
            raise InvalidParameterError(
                "kv_events_config",
                f"with {replicas} replicas the endpoint binds ports {a}-{b} and the "
                f"replay_endpoint {c}-{d}: space their ports by at least the number of "
                "replicas (--replicas and --standby-replicas)",
            )


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (vLLM's rule): a wildcard address
    (``tcp://*:5557``, ``tcp://[::]:5557``) or a local transport (``ipc://``,
    ``inproc://``); any other (``tcp://indexer:5557``) is connected to a subscriber that
    binds it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _offset(endpoint: str, rank: int, name: str) -> str:
    """``endpoint`` for ``rank``: a TCP port + ``rank``, an ``ipc://`` / ``inproc://`` name
    with ``_dp<rank>`` after it (vLLM's suffix)."""
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise InvalidParameterError(
            "kv_events_config", f"{name} {endpoint!r}: a bound TCP endpoint needs a port number"
        )
    return f"{base}:{int(port) + rank}"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def lora_id(adapter_id: str | None) -> int | None:
    """vLLM's integer LoRA id of an adapter (ours are named): a stable 31-bit number."""
    return None if adapter_id is None else zlib.crc32(adapter_id.encode()) & 0x7FFFFFFF
