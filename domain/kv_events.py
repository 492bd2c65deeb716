"""KV cache events, vLLM's (``vllm.distributed.kv_events``): the prefix cache's blocks as
they are stored (a full block's KV computed and named by its chained hash) and removed
(evicted), which a KV-aware router (llm-d's, Dynamo's, vLLM's own) follows to know what each
replica holds. Published after each engine step (``--kv-events-config``; off by default).
"""

import zlib
from dataclasses import dataclass

from domain.errors import InvalidParameterError

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields: ``enable_kv_cache_events`` records the events;
    ``publisher`` ``zmq`` sends them (``null``: recorded, sent nowhere) on a ZeroMQ PUB socket
    bound at ``endpoint``, each message ``[topic, sequence number, msgpack batch]``."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise InvalidParameterError(
                "kv_events_config", f"publisher must be one of {', '.join(PUBLISHERS)}"
            )

    @property
    def recording(self) -> bool:
        return self.enable_kv_cache_events


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
