"""Paged KV cache accounting: fixed-size blocks, per-request block tables, prefix reuse.

The runner keeps KV in a pool of ``num_blocks`` blocks of ``block_size`` positions; this
module decides which block holds which request's positions (no tensors here). A block is
in exactly one of three states:

- *empty*: free, caches nothing; used first when a fresh block is needed;
- *cached*: free, but its KV is a full block of known content (its hash is in the hash
  map), so a later request with the same prefix can reuse it; evicted least recently
  freed first when no empty block is left;
- *referenced*: in the block tables of ``ref_count`` requests (shared prefixes, forks).

Prefix reuse. Once a block is full and its KV computed (:meth:`BlockManager.commit`), it is
named by a hash chained over (parent block's hash, its token ids, adapter id): a block's
KV depends on every token before it and on the LoRA adapter, and on nothing else. The hash
is SHA-256 over a compact encoding, stable across processes (no ``PYTHONHASHSEED`` salt)
and collision-resistant, so a crafted prompt cannot pose as another's prefix (Python's
``hash`` of a tuple could be forced to collide; vLLM moved to SHA-256 for that reason).
Token ids are encoded in native byte order: the cache lives in one process.

How the scheduler uses it (wired in the next step of issue 15):

- admission: ``prefix = find_cached_prefix(tokens, adapter_id)`` (an empty ``CachedPrefix``
  for requests that need prompt logprobs: those positions must run), then
  ``allocate(id, prefix.num_tokens + chunk, adapter_id=..., prefix=prefix)``; None leaves
  the request waiting (admission is by free blocks, ``max_num_seqs`` only caps the count);
  otherwise ``num_computed_tokens = prefix.num_tokens``;
- each running request's chunk: ``allocate(id, start + num_tokens)``; None preempts the
  lowest-priority, youngest running request (``free`` it, recompute later, when its own
  blocks are likely still cached) and retries, the request itself last;
- after the step (``update_from_output``): ``commit(id, tokens, num_computed_tokens)``;
- released (finished, aborted, preempted): ``free(id)``;
- ``n`` > 1 choices: ``fork(source_id, id, num_prompt_tokens - 1)`` replaces the KV copy;
- ``SchedulerOutput`` carries each chunk's block table (``block_table(id)``) for the runner;
- the observer: ``usage`` as ``SchedulerStats.kv_usage``, per-step deltas of
  ``prefix_queried_tokens`` / ``prefix_hit_tokens``; preemptions are already reported.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from domain.kv_events import BlockRemoved, BlockStored, KVEvent, lora_id

BlockHash = bytes
EVICTION_LOG = 4096  # evicted hashes kept for take_evicted()
_ROOT: BlockHash = b""  # the parent of a request's first block


def hash_block(parent: BlockHash, token_ids: Sequence[int], adapter_id: str | None) -> BlockHash:
    """The chained hash naming a full block's KV."""
    digest = hashlib.sha256(parent)
    # None (the base model) and every adapter name encode differently, "" included.
    digest.update(b"\x00" if adapter_id is None else b"\x01" + adapter_id.encode() + b"\x00")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its KV computed, while it is the one the hash map
    # names for that content (a duplicate computed alongside stays unnamed).
    block_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """Cached blocks holding the KV of a token sequence's first ``num_tokens`` positions
    (whole blocks, never the last token: it must run so that the request gets logits)."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[BlockHash, ...] = ()
    num_tokens: int = 0
    num_queried_tokens: int = 0  # the sequence's length: what the lookup asked for


@dataclass(slots=True)
class _RequestBlocks:
    adapter_id: str | None
    block_ids: list[int] = field(default_factory=list)
    # The hashes of the leading blocks whose KV is computed (a prefix of block_ids).
    block_hashes: list[BlockHash] = field(default_factory=list)


class BlockManager:
    """The block pool, the requests' block tables and the prefix cache.

    ``allocate`` is all or nothing: None (nothing changed) when the free blocks do not
    suffice, and the caller preempts. Counters are cumulative; the observer takes deltas.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        record_events: bool = False,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks {num_blocks}, block_size {block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._by_hash: dict[BlockHash, int] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_queried_tokens = 0  # tokens of admitted requests looked up
        self.prefix_hit_tokens = 0  # of those, found cached
        # The hashes of cached blocks evicted since the last take_evicted() (the newest
        # EVICTION_LOG: a fleet's router corrects what it thinks this pool holds).
        self._evicted: deque[BlockHash] = deque(maxlen=EVICTION_LOG)
        # vLLM's KV cache events since the last take_events() (None: not recorded).
        self._events: list[KVEvent] | None = [] if record_events and enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Empty plus cached blocks: all can be handed out."""
        return len(self._empty) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that keep reusable KV."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """The fraction of blocks referenced by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.prefix_queried_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    def __contains__(self, request_id: object) -> bool:
        """Whether the request holds a block table."""
        return request_id in self._requests

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks, position ``p`` in block ``p // block_size`` (a copy)."""
        entry = self._requests.get(request_id)
        return list(entry.block_ids) if entry else []

    def find_cached_prefix(
        self, token_ids: Sequence[int], adapter_id: str | None = None
    ) -> CachedPrefix:
        """The longest run of cached full blocks starting ``token_ids``, short of its last
        token. Use it in ``allocate`` before any other allocation (which could evict it)."""
        found: list[int] = []
        hashes: list[BlockHash] = []
        if self.enable_caching:
            parent, size = _ROOT, self.block_size
            for start in range(0, (len(token_ids) - 1) // size * size, size):
                parent = hash_block(parent, token_ids[start : start + size], adapter_id)
                block_id = self._by_hash.get(parent)
                if block_id is None:
                    break
                found.append(block_id)
                hashes.append(parent)
        num_tokens = len(found) * self.block_size
        return CachedPrefix(tuple(found), tuple(hashes), num_tokens, len(token_ids))

    def can_allocate(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Whether the request's KV can grow to ``num_tokens`` positions now."""
        return self._num_new_blocks(request_id, num_tokens, prefix) <= self._available(
            request_id, prefix
        )

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        adapter_id: str | None = None,
        prefix: CachedPrefix | None = None,
    ) -> list[int] | None:
        """Grow the request's block table to hold ``num_tokens`` positions (computed ones
        plus this step's). A request's first call creates its table, starting with
        ``prefix``'s blocks (shared; its tokens count as computed) and fixing its adapter;
        ``prefix`` is ignored afterwards. Returns the blocks appended to the table (maybe
        none), or None when too few blocks are free (nothing changed: the caller preempts)."""
        if not self.can_allocate(request_id, num_tokens, prefix):
            return None
        entry = self._requests.get(request_id)
        added: list[int] = []
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks(adapter_id)
            if prefix is not None:
                added += self._take_prefix(entry, prefix)
        count = self._num_new_blocks(request_id, num_tokens, None)
        fresh = [self._fresh_block() for _ in range(count)]
        entry.block_ids += fresh
        return added + fresh

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The request's KV now holds its first ``num_computed_tokens`` positions (of
        ``token_ids``): name its newly filled blocks in the hash map for reuse."""
        entry = self._requests[request_id]
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        assert num_full <= len(entry.block_ids), "commit beyond the allocated blocks"
        for index in range(len(entry.block_hashes), num_full):
            start = index * self.block_size
            parent = entry.block_hashes[-1] if entry.block_hashes else _ROOT
            tokens = token_ids[start : start + self.block_size]
            entry.block_hashes.append(hash_block(parent, tokens, entry.adapter_id))
            named = self._name(entry.block_ids[index], entry.block_hashes[-1])
            if named and self._events is not None:
                self._events.append(
                    BlockStored(
                        (entry.block_hashes[-1],),
                        parent or None,
                        tuple(tokens),
                        self.block_size,
                        lora_id(entry.adapter_id),
                    )
                )

    def fork(self, source_id: str, request_id: str, num_tokens: int) -> int:
        """Start ``request_id``'s table with ``source_id``'s full blocks among its first
        ``num_tokens`` positions, shared (their KV must be computed). The rest, a partial
        block included, the new request computes itself: at most ``block_size - 1``
        positions plus what follows, and no copy-on-write in the runner. Returns the
        positions shared (the new request's computed tokens)."""
        assert request_id not in self._requests, f"{request_id} already holds blocks"
        source = self._requests[source_id]
        count = min(num_tokens // self.block_size, len(source.block_ids))
        shared = source.block_ids[:count]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        hashes = source.block_hashes[:count]
        self._requests[request_id] = _RequestBlocks(source.adapter_id, shared, hashes)
        return count * self.block_size

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks beyond those ``num_tokens`` positions need
        (rejected speculative drafts' KV: never computed for good, never named)."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        keep = max(self.num_blocks_for(num_tokens), len(entry.block_hashes))
        for block_id in reversed(entry.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._empty.appendleft(block_id)
                else:
                    self._cached[block_id] = None
        del entry.block_ids[keep:]

    def free(self, request_id: str) -> None:
        """Drop the request's table (unknown ids are ignored). Blocks no longer referenced
        become free: named ones stay cached, the table's tail ahead of its head in the
        eviction order (a chain is only reusable from its start)."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        for block_id in reversed(entry.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._empty.append(block_id)
            else:
                self._cached[block_id] = None

    def _num_new_blocks(self, request_id: str, num_tokens: int, prefix: CachedPrefix | None) -> int:
        entry = self._requests.get(request_id)
        held = len(entry.block_ids) if entry else 0
        if entry is None and prefix is not None:
            held = len(prefix.block_ids)
        return max(0, self.num_blocks_for(num_tokens) - held)

    def _available(self, request_id: str, prefix: CachedPrefix | None) -> int:
        """Free blocks left for fresh allocation once ``prefix`` (if used) is taken."""
        if prefix is None or request_id in self._requests:
            return self.num_free_blocks
        taken = sum(self.blocks[b].ref_count == 0 for b in prefix.block_ids)
        return self.num_free_blocks - taken

    def _take_prefix(self, entry: _RequestBlocks, prefix: CachedPrefix) -> list[int]:
        for block_id, block_hash in zip(prefix.block_ids, prefix.block_hashes, strict=True):
            block = self.blocks[block_id]
            assert block.block_hash == block_hash, "a cached prefix used after eviction"
            if block.ref_count == 0:
                del self._cached[block_id]
            block.ref_count += 1
        entry.block_ids += prefix.block_ids
        entry.block_hashes += prefix.block_hashes
        self.prefix_queried_tokens += prefix.num_queried_tokens
        self.prefix_hit_tokens += prefix.num_tokens
        return list(prefix.block_ids)

    def _fresh_block(self) -> int:
        """An empty block, else the least recently freed cached one (its KV forgotten)."""
        if self._empty:
            block_id = self._empty.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            self._evicted.append(self._forget(self.blocks[block_id]))
        self.blocks[block_id].ref_count = 1
        return block_id

    def _name(self, block_id: int, block_hash: BlockHash) -> bool:
        """Enter a computed full block in the hash map, unless its content is there already
        (computed alongside by another request) or the block is named (shared): whether
        it was entered."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block_id
            return True
        return False

    def _forget(self, block: KVBlock) -> BlockHash:
        forgotten = block.block_hash
        assert forgotten is not None
        del self._by_hash[forgotten]
        block.block_hash = None
        if self._events is not None:
            self._events.append(BlockRemoved((forgotten,)))
        return forgotten

    def take_events(self) -> list[KVEvent]:
        """vLLM's KV cache events since the last call (none when not recorded)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def take_evicted(self) -> list[BlockHash]:
        """The hashes of cached blocks evicted since the last call (at most the newest
        ``EVICTION_LOG``)."""
        evicted = list(self._evicted)
        self._evicted.clear()
        return evicted
