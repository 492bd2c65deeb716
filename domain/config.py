"""Engine configuration (seed 000 §2), validated at construction."""

from dataclasses import dataclass

from domain.errors import InvalidParameterError

BATCHING_MODES = ("static", "continuous")
SCHEDULER_POLICIES = ("fcfs",)
KV_CACHE_BACKENDS = ("contiguous",)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None
    max_seq_len: int = 4096
    max_batch_size: int = 8
    max_waiting_requests: int = 64
    seed: int | None = None
    batching_mode: str = "continuous"
    scheduler_policy: str = "fcfs"
    batch_wait_timeout_s: float = 0.05
    # Continuous batching: tokens one step may run across all requests (prefill chunks
    # included), so a long prompt cannot stall every running stream for a whole prefill.
    max_num_batched_tokens: int = 512
    kv_cache_backend: str = "contiguous"

    def __post_init__(self) -> None:
        _one_of("batching_mode", self.batching_mode, BATCHING_MODES)
        _one_of("scheduler_policy", self.scheduler_policy, SCHEDULER_POLICIES)
        _one_of("kv_cache_backend", self.kv_cache_backend, KV_CACHE_BACKENDS)
        for name in ("max_seq_len", "max_batch_size", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        if self.batch_wait_timeout_s < 0:
            raise InvalidParameterError("batch_wait_timeout_s", "must be >= 0")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise InvalidParameterError(
                "max_num_batched_tokens", "must be at least max_batch_size (one token each)"
            )


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidParameterError(name, f"{value!r} is not one of {', '.join(allowed)}")
