"""Engine configuration, validated at construction."""

from dataclasses import dataclass

from domain.errors import InvalidParameterError
from domain.kv_events import KVEventsConfig
from domain.speculation import SpeculativeConfig

BATCHING_MODES = ("static", "continuous")
# Weight-only quantization of a model's linears (adapters/torch/quant.py): int8 per output
# channel, int4 group-wise, or a GGUF file's own blocks.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_waiting_requests: int = 64
    batching_mode: str = "continuous"
    batch_wait_timeout: float = 0.05
    # Continuous batching: tokens one step may run across all requests (prefill chunks
    # included), so a long prompt cannot stall every running stream for a whole prefill.
    max_num_batched_tokens: int = 512
    # Request limits (an InvalidParameterError naming the field beyond them, HTTP 400/422):
    # a prompt's UTF-8 size (a chat: its messages' text), prompts in one request, choices
    # per prompt, entries
    # of ``stop`` and of ``stop_token_ids``, and the stop strings' total UTF-8 size.
    max_prompt_bytes: int = 1 << 20
    max_prompts_per_request: int = 64
    # Choices per prompt (OpenAI's ``n``): each is a request, counted against the queue.
    max_n: int = 16
    max_stop_strings: int = 64
    max_stop_bytes: int = 4096
    # Threads tokenizing prompts and rendering chats off the event loop (at most this many
    # requests are prepared at once; others wait their turn, without blocking the loop).
    prepare_threads: int = 2
    # Special-token text inside chat message content is parsed as control tokens (the old
    # behaviour: only for trusted callers; by default it is plain text).
    trust_chat_special_tokens: bool = False
    # Paged KV cache (continuous and static batching): positions per block, blocks in the
    # pool (None: ``max_num_seqs`` requests at ``max_model_len`` each, as contiguous slots
    # held), and prefix caching (full blocks of computed KV reused by later requests).
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    prefix_caching: bool = True
    # Every step runs eagerly (vLLM's --enforce-eager); by default a GPU runner replays
    # decode-only steps as CUDA graphs captured at start-up.
    enforce_eager: bool = False
    # Speculative decoding (``--speculative-config``; None: off): drafts verified in the
    # step's forward, continuous batching only.
    speculative_config: SpeculativeConfig | None = None
    # A row's logits do not depend on what shares its step (``--batch-invariant``): one
    # kernel path per row whatever the step holds (the torch runner on a CPU).
    batch_invariant: bool = False
    # vLLM's KV cache events (``--kv-events-config``; None: off): the prefix cache's stored
    # and evicted blocks, published after each step for KV-aware routers.
    kv_events_config: KVEventsConfig | None = None

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most: running plus waiting."""
        return self.max_num_seqs + self.max_waiting_requests

    @property
    def kv_blocks(self) -> int:
        """The KV pool's size in blocks (``num_kv_blocks``, or its default)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return self.max_num_seqs * self.blocks_per_sequence

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one request of ``max_model_len`` positions holds."""
        return -(-self.max_model_len // self.kv_block_size)

    def __post_init__(self) -> None:
        _one_of("batching_mode", self.batching_mode, BATCHING_MODES)
        if self.speculative_config is not None and self.batching_mode != "continuous":
            raise InvalidParameterError(
                "speculative_config", "speculative decoding needs continuous batching"
            )
        positive = (
            "max_model_len",
            "max_num_seqs",
            "max_waiting_requests",
            "max_prompt_bytes",
            "max_prompts_per_request",
            "max_n",
            "prepare_threads",
            "kv_block_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        for name in ("max_stop_strings", "max_stop_bytes"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(name, "must be >= 0")
        if self.batch_wait_timeout < 0:
            raise InvalidParameterError("batch_wait_timeout", "must be >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.blocks_per_sequence:
            raise InvalidParameterError(
                "num_kv_blocks",
                f"must hold one request of max_model_len = {self.max_model_len} positions: "
                f"{self.blocks_per_sequence} blocks of {self.kv_block_size} at least",
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidParameterError(
                "max_num_batched_tokens", "must be at least max_num_seqs (one token each)"
            )


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidParameterError(name, f"{value!r} is not one of {', '.join(allowed)}")
