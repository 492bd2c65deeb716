"""TorchModelRunner: the ModelRunner port over our models, for static and continuous batching.

Each running request owns a slot of a preallocated :class:`SlotKVCache` (occupied slots are
kept compacted: a freed slot takes the last one's contents). A step runs the decoding
requests' tokens (each row at its own position) and the prompt chunks as one flat forward
(:class:`MixedBatch`: one matmul per projection for every token of the step), then one
sampler call samples every row that needs a token.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from adapters.torch.kv_cache import SlotKVCache
from adapters.torch.layers import MixedBatch
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
        if not batch.chunks:
            return RunnerOutput()
        for chunk in batch.chunks:
            self._ensure_slot(chunk)
        slot_of = {request_id: slot for slot, request_id in enumerate(self.slots)}
        slots = {id(c): slot_of[c.request.request_id] for c in batch.chunks}  # id(chunk) -> slot
        singles = [c for c in batch.chunks if c.num_tokens == 1]
        prompts = [c for c in batch.chunks if c.num_tokens > 1]
        sampled = [c for c in batch.chunks if c.samples]
        with torch.inference_mode():
            return self._sample(sampled, self._forward(singles, prompts, sampled, slots))

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

    def _forward(
        self,
        singles: list[ScheduledChunk],
        prompts: list[ScheduledChunk],
        sampled: list[ScheduledChunk],
        slots: dict[int, int],
    ) -> Tensor:
        """Logits ``[len(sampled), vocab]`` of one step: the decode rows (if any) and every
        prompt chunk's tokens run as one flat forward (see :class:`MixedBatch`)."""
        tokens, positions = self._decode_rows(singles, slots) if singles else ([], [])
        row_of = {id(c): slots[id(c)] for c in singles}
        chunks = []
        for chunk in prompts:
            row_of[id(chunk)] = len(tokens) + chunk.num_tokens - 1
            chunks.append((slots[id(chunk)], chunk.start, chunk.num_tokens))
            tokens.extend(chunk.token_ids)
        batch = MixedBatch(self.cache, positions, chunks, self.model.windows(), self.device)
        logits = self.model.forward_mixed(
            torch.tensor(tokens, device=self.device),
            batch,
            torch.tensor([row_of[id(c)] for c in sampled], dtype=torch.long, device=self.device),
        )
        for chunk in singles + prompts:  # the positions this step wrote
            self.lengths[slots[id(chunk)]] = chunk.start + chunk.num_tokens
        return logits

    def _decode_rows(
        self, singles: list[ScheduledChunk], slots: dict[int, int]
    ) -> tuple[list[int], list[int]]:
        """Token and position of every occupied slot's row: a decoding request's token, or
        for a slot without one this step (mid-prefill) a placeholder at its next free
        position, which a later write overwrites."""
        by_slot = {slots[id(c)]: c for c in singles}
        last = self.cache.max_seq_len - 1
        rows = range(len(self.slots))
        tokens = [by_slot[s].token_ids[0] if s in by_slot else 0 for s in rows]
        positions = [by_slot[s].start if s in by_slot else min(self.lengths[s], last) for s in rows]
        return tokens, positions

    def _sample(self, chunks: list[ScheduledChunk], logits: Tensor) -> RunnerOutput:
        """``logits`` ``[len(chunks), vocab]``, in ``chunks`` order."""
        if not chunks:
            return RunnerOutput()
        requests = [c.request for c in chunks]
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
