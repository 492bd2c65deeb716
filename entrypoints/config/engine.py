"""``infer serve`` flags for the engine: batching, the running cap and context length, the
KV pool; :class:`EngineSettings` holds them (and the request limits of
:mod:`entrypoints.config.request`) under the flags' names, which are :class:`EngineConfig`'s
(the domain's) too: a new engine flag is its argument, a field here and in ``EngineConfig``
under the same name, and its use."""

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from dataclasses import fields as dataclass_fields
from typing import TypeVar

from domain.config import EngineConfig
from domain.kv_events import KVEventsConfig
from domain.memory import (
    AUTO,
    CPU_AUTO_CAP,
    CPU_AUTO_FRACTION,
    CUDA_AUTO_FRACTION,
    KVCacheMemory,
    human_size,
    parse_kv_cache_memory,
)
from domain.speculation import METHODS, SpeculativeConfig
from entrypoints.config.flag_fields import from_flags
from entrypoints.config.request import request_limits

# vLLM's methods that need heads trained for the target (not served here).
UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")

# ``infer serve``'s speculative decoding when --speculative-config is not given: on a CPU,
# prompt lookup, each step drafting what pays at the step costs the runner measured on
# this machine (docs/speculative.md); on a GPU none (not measured there).
# ``--speculative-config none`` turns it off.
SPECULATIVE_BY_DEVICE: dict[str, SpeculativeConfig | None] = {
    "cpu": SpeculativeConfig(),
    "cuda": None,
}
SPECULATION_OFF = ("none", "off", "null")

# ``infer serve``'s --max-num-seqs by device: vLLM's 256 on a GPU; on a CPU 64, where the
# default model's aggregate throughput peaks on 2 vCPUs (benchmarks/README.md).
MAX_NUM_SEQS = {"cpu": 64, "cuda": 256}

_DEFAULTS = EngineConfig()
C = TypeVar("C")


@dataclass(frozen=True)
class EngineSettings:
    """The engine's flags under their names (``--max-num-seqs``: ``max_num_seqs``,
    ``--no-prefix-caching``: ``prefix_caching`` False); the defaults are
    :class:`EngineConfig`'s (``infer serve``'s own come from :meth:`from_args`). Checked
    at construction by the :class:`EngineConfig` they make (its errors name its fields,
    which are the flags)."""

    max_num_seqs: int = _DEFAULTS.max_num_seqs
    max_model_len: int = _DEFAULTS.max_model_len
    max_waiting_requests: int = _DEFAULTS.max_waiting_requests
    batching_mode: str = _DEFAULTS.batching_mode
    batch_wait_timeout: float = _DEFAULTS.batch_wait_timeout
    max_num_batched_tokens: int = _DEFAULTS.max_num_batched_tokens
    max_prompt_bytes: int = _DEFAULTS.max_prompt_bytes
    max_prompts_per_request: int = _DEFAULTS.max_prompts_per_request
    max_n: int = _DEFAULTS.max_n
    max_stop_strings: int = _DEFAULTS.max_stop_strings
    max_stop_bytes: int = _DEFAULTS.max_stop_bytes
    prepare_threads: int = _DEFAULTS.prepare_threads
    trust_chat_special_tokens: bool = _DEFAULTS.trust_chat_special_tokens
    kv_block_size: int = _DEFAULTS.kv_block_size
    num_kv_blocks: int | None = _DEFAULTS.num_kv_blocks
    prefix_caching: bool = _DEFAULTS.prefix_caching
    enforce_eager: bool = _DEFAULTS.enforce_eager
    speculative_config: SpeculativeConfig | None = _DEFAULTS.speculative_config
    kv_events_config: KVEventsConfig | None = _DEFAULTS.kv_events_config
    batch_invariant: bool = _DEFAULTS.batch_invariant

    def __post_init__(self) -> None:
        self.engine_config()

    def engine_config(self) -> EngineConfig:
        """The domain's configuration: these values."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def of(cls, config: EngineConfig) -> "EngineSettings":
        """``config``'s values."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: str) -> "EngineSettings":
        """``infer serve``'s values; ``--max-num-seqs`` by default by ``device`` (the one
        the model loads on)."""
        max_num_seqs = args.max_num_seqs
        if max_num_seqs is None:  # vLLM's default on a GPU; what a CPU serves well
            max_num_seqs = MAX_NUM_SEQS["cuda" if device.startswith("cuda") else "cpu"]
        speculative = speculation(args.speculative_config, device, args.batching_mode)
        return from_flags(
            cls,
            args,
            max_num_seqs=max_num_seqs,
            speculative_config=speculative,
            **request_limits(args),
        )


def add_engine_args(serve: argparse.ArgumentParser) -> None:
    """The engine's flags, in the order ``--help`` lists them."""
    _add_batching_args(serve)
    _add_kv_pool_args(serve)
    _add_execution_args(serve)
    _add_vllm_json_args(serve)


def _add_batching_args(serve: argparse.ArgumentParser) -> None:
    """The running cap, the queue, the context length, the prefill budget, prefix caching."""
    serve.add_argument(
        "--max-batch-size",
        "--max-num-seqs",
        dest="max_num_seqs",
        metavar="MAX_BATCH_SIZE",
        type=int,
        default=None,
        help=f"running requests at most (default: {MAX_NUM_SEQS['cpu']} on a CPU, "
        f"{MAX_NUM_SEQS['cuda']} on a GPU)",
    )
    serve.add_argument("--batching-mode", default="continuous", choices=["continuous", "static"])
    serve.add_argument("--max-waiting-requests", type=int, default=64, help="beyond: HTTP 503")
    serve.add_argument(
        "--max-seq-len",
        "--max-model-len",
        dest="max_model_len",
        metavar="MAX_SEQ_LEN",
        type=int,
        default=2048,
        help="prompt + output tokens",
    )
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse cached KV blocks of shared prefixes)",
    )


def _add_kv_pool_args(serve: argparse.ArgumentParser) -> None:
    """The KV pool: its budget (or its blocks) and its block size."""
    kv_pool = serve.add_mutually_exclusive_group()
    kv_pool.add_argument(
        "--kv-cache-memory",
        type=kv_cache_memory,
        default=None,
        metavar="SIZE|FRACTION|auto",
        help="KV cache budget: a size (512MiB, 4GiB, 2GB, bytes) or a fraction in (0, 1] "
        "(CUDA: of the device's memory, the model's share included, as vLLM's "
        "--gpu-memory-utilization; CPU: of the memory available now); the KV blocks fill it "
        f"(default auto: {CUDA_AUTO_FRACTION:g} on CUDA; on a CPU {CPU_AUTO_FRACTION:g} of "
        f"the memory available, at most {human_size(CPU_AUTO_CAP)})",
    )
    kv_pool.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV blocks in the pool (instead)"
    )
    serve.add_argument(
        "--kv-block-size", type=int, default=16, help="positions per KV block (default 16)"
    )


def _add_execution_args(serve: argparse.ArgumentParser) -> None:
    """How steps run: eager or CUDA graphs, static batching's wait, batch invariance."""
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (default on a GPU: decode steps replay CUDA graphs "
        "captured at start-up)",
    )
    serve.add_argument("--batch-wait-timeout", type=float, default=0.05, help="static mode")
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs do not depend on what shares its steps (other "
        "requests, prefix cache hits, chunked prefill, drafts): one kernel path per row, on a "
        "CPU (off by default: it costs throughput at many rows and prefill speed; "
        "docs/batch-invariance.md)",
    )


def _add_vllm_json_args(serve: argparse.ArgumentParser) -> None:
    """vLLM's JSON-spelled configs: speculative decoding and KV cache events."""
    serve.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help="speculative decoding, vLLM's spelling: "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}\' (prompt lookup), "method": "suffix" (also drafts '
        "from recent requests' outputs) or '{\"model\": DRAFT}' (a smaller model with the "
        "same tokenizer, method draft_model); none: off. Default: on a CPU prompt lookup "
        '(\'{"method": "ngram", "num_speculative_tokens": 3}\', each step drafting what '
        "pays at this machine's measured step costs), on a GPU off (docs/speculative.md)",
    )
    serve.add_argument(
        "--kv-events-config",
        type=kv_events_config,
        default=None,
        metavar="JSON",
        help="publish the prefix cache's stored and evicted blocks for KV-aware routers, "
        'vLLM\'s spelling and wire format: \'{"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\' (msgpack batches on a '
        "ZeroMQ PUB socket, bound at a wildcard endpoint, else connected; "
        '"replay_endpoint", "buffer_steps", "hwm", "max_queue_size" as vLLM\'s; with '
        "--replicas each replica publishes, a bound port + its rank; default: off)",
    )


def speculation(
    flag: SpeculativeConfig | str | None, device: str, batching_mode: str = "continuous"
) -> SpeculativeConfig | None:
    """``--speculative-config``'s value as the engine takes it: not given, the device's
    default (continuous batching only); ``none``: off."""
    if flag is None:
        kind = "cuda" if device.startswith("cuda") else "cpu"
        return SPECULATIVE_BY_DEVICE[kind] if batching_mode == "continuous" else None
    return None if isinstance(flag, str) else flag


def _vllm_config(cls: type[C], name: str, text: str, adjust: Callable[[dict], None]) -> C:
    """A JSON object of vLLM's ``name`` fields as ``cls`` (``adjust``: checks and vLLM's
    readings on the raw fields first); argparse names the flag in its error, this the
    field."""
    try:
        fields_ = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(fields_, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of vLLM's {name} fields")
    adjust(fields_)
    known = {f.name for f in dataclass_fields(cls)}  # type: ignore[arg-type]
    for field in fields_:
        if field not in known:
            raise argparse.ArgumentTypeError(
                f"{name}.{field}: unknown field (known: {', '.join(sorted(known))})"
            )
    try:
        return cls(**fields_)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON (vLLM's ``KVEventsConfig`` fields we take)."""
    return _vllm_config(KVEventsConfig, "kv_events_config", text, lambda _: None)


def _speculative_fields(fields_: dict) -> None:
    if fields_.get("method") in UNSUPPORTED_METHODS:
        raise argparse.ArgumentTypeError(
            f"speculative_config.method {fields_['method']!r}: not supported (it needs heads "
            f"trained for the target); use one of {', '.join(METHODS)}"
        )
    if "model" in fields_ and "method" not in fields_:
        fields_["method"] = "draft_model"  # vLLM's reading of a config naming a model


def speculative_config(text: str) -> SpeculativeConfig | str:
    """``--speculative-config``'s JSON (or ``none``: off)."""
    if text.strip().lower() in SPECULATION_OFF:
        return SPECULATION_OFF[0]
    return _vllm_config(SpeculativeConfig, "speculative_config", text, _speculative_fields)


def kv_cache_memory(text: str) -> KVCacheMemory | str:
    """``--kv-cache-memory``'s value; argparse names the flag in its error."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_kv_cache_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
