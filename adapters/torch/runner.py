"""TorchModelRunner: the ModelRunner port over our models, for static and continuous batching.

Each running request owns a slot of a preallocated :class:`SlotKVCache` (occupied slots are
kept compacted: a freed slot takes the last one's contents). A step runs every multi-token
chunk (a prompt, or a prompt chunk) as a batch-1 forward on its slot, then every one-token
chunk in one batched decode forward where each row sits at its own position, then samples
all rows that need a token in one sampler call.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from adapters.torch.kv_cache import SlotKVCache
from adapters.torch.sampler import Sampler, make_generator
from adapters.torch.transformer import Transformer
from domain.config import EngineConfig
from domain.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput


class TorchModelRunner:
    def __init__(self, model: Transformer, config: EngineConfig, sampler: Sampler | None = None):
        self.model = model
        self.sampler = sampler or Sampler()
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.cache = SlotKVCache(
            model.config,
            config.max_batch_size,
            config.max_seq_len,
            dtype=weight.dtype,
            device=weight.device,
        )
        self.slots: list[str] = []  # slot index -> request id
        self.lengths: list[int] = []  # positions written per slot
        self.generators: dict[str, torch.Generator | None] = {}

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        for chunk in batch.chunks:
            self._ensure_slot(chunk)
        logits: dict[str, Tensor] = {}
        decoded: Tensor | None = None
        with torch.inference_mode():
            for chunk in batch.chunks:
                if chunk.num_tokens > 1:
                    logits.update(self._prefill(chunk))
            singles = [c for c in batch.chunks if c.num_tokens == 1]
            if singles:
                decoded = self._decode(singles)
                logits.update({c.request.request_id: decoded[i] for i, c in enumerate(singles)})
            sampled = [c for c in batch.chunks if c.samples]
            if decoded is not None and _same(sampled, singles):  # the usual decode step: no copy
                return self._sample(sampled, decoded)
            return self._sample(sampled, logits)

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            if request_id not in self.generators:
                continue  # never ran here, or already released
            del self.generators[request_id]
            slot, last = self.slots.index(request_id), len(self.slots) - 1
            if slot != last:  # keep occupied slots contiguous for the batched decode
                self.cache.move(last, slot, self.lengths[last])
                self.slots[slot], self.lengths[slot] = self.slots[last], self.lengths[last]
            self.slots.pop()
            self.lengths.pop()

    def _ensure_slot(self, chunk: ScheduledChunk) -> None:
        request = chunk.request
        if request.request_id in self.generators:
            return
        if len(self.slots) >= self.cache.k.shape[1]:
            raise RuntimeError("no free KV slot: more running requests than max_batch_size")
        self.slots.append(request.request_id)
        self.lengths.append(0)
        seed = request.sampling_params.seed
        self.generators[request.request_id] = (
            make_generator(seed, self.device) if seed is not None else None
        )

    def _prefill(self, chunk: ScheduledChunk) -> dict[str, Tensor]:
        slot = self.slots.index(chunk.request.request_id)
        ids = torch.tensor([chunk.token_ids], device=self.device)
        out = self.model(ids, kv_cache=self.cache.slot(slot, chunk.start))
        self.lengths[slot] = chunk.start + chunk.num_tokens
        return {chunk.request.request_id: out[0, -1]}

    def _decode(self, chunks: list[ScheduledChunk]) -> Tensor:
        """Logits ``[len(chunks), vocab]`` in ``chunks`` order.

        Every occupied slot is a row; slots without a token this step (mid-prefill) get a
        placeholder at their next free position, which a later write overwrites.
        """
        by_slot = {self.slots.index(c.request.request_id): c for c in chunks}
        rows = len(self.slots)
        last = self.cache.max_seq_len - 1
        tokens = [by_slot[s].token_ids[0] if s in by_slot else 0 for s in range(rows)]
        positions = [
            by_slot[s].start if s in by_slot else min(self.lengths[s], last) for s in range(rows)
        ]
        out = self.model.decode(
            torch.tensor(tokens, device=self.device)[:, None], self.cache, positions
        )[:, 0]
        for slot, chunk in by_slot.items():
            self.lengths[slot] = chunk.start + 1
        order = list(by_slot)
        return out if order == list(range(rows)) else out[torch.tensor(order, device=self.device)]

    def _sample(
        self, chunks: list[ScheduledChunk], logits: dict[str, Tensor] | Tensor
    ) -> RunnerOutput:
        """``logits``: per request, or one ``[len(chunks), vocab]`` tensor in ``chunks`` order."""
        if not chunks:
            return RunnerOutput()
        requests = [c.request for c in chunks]
        if isinstance(logits, dict):
            logits = torch.stack([logits[r.request_id] for r in requests])
        result = self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            prompt_ids=[r.prompt_token_ids for r in requests],
            output_ids=[r.generated_token_ids for r in requests],
            generators=[self.generators[r.request_id] for r in requests],
        )
        ids = [r.request_id for r in requests]
        return RunnerOutput(
            sampled_token_ids=dict(zip(ids, result.token_ids, strict=True)),
            logprobs=dict(zip(ids, result.logprobs, strict=True)) if result.logprobs else {},
        )


def _same(a: list[ScheduledChunk], b: list[ScheduledChunk]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
