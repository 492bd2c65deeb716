"""The Tinker API's settings (:class:`TinkerSettings`) and ``infer serve``'s flags for its
per-key limits (:class:`TinkerLimits`)."""

import argparse
import os
from dataclasses import dataclass, field

from domain.errors import InvalidParameterError
from domain.tinker.values import TinkerLimits

TRAINING_BACKENDS = ("lora", "toy")
_DEFAULTS = TinkerLimits()


@dataclass(frozen=True)
class TinkerSettings:
    """``enabled``: serve the Tinker fine-tuning API (``infer serve``: unless
    ``--no-tinker``); ``checkpoint_dir``: where checkpoints and runs are kept (None:
    ``~/.cache/infer/tinker``); ``tinker_api_keys``: the keys it accepts (None: any ``tml-``
    key); ``tinker_aliases``: more names the model is advertised under (none by default);
    ``training_backend``: ``lora`` (LoRA on the model) or ``toy`` (numpy, no
    model: the tests'); ``limits``: per key, the ``--tinker-max-*`` flags."""

    enabled: bool = False
    checkpoint_dir: str | None = None
    tinker_api_keys: frozenset[str] | None = None
    tinker_aliases: tuple[str, ...] = ()
    training_backend: str = "lora"
    limits: TinkerLimits = field(default_factory=TinkerLimits)

    def __post_init__(self) -> None:
        if self.training_backend not in TRAINING_BACKENDS:
            raise ValueError(
                f"training_backend must be one of {', '.join(TRAINING_BACKENDS)}, "
                f"got {self.training_backend!r}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_num_seqs: int) -> "TinkerSettings":
        """``infer serve``'s settings (the keys also from ``INFER_TINKER_API_KEYS``);
        ``max_num_seqs``: ``--tinker-max-sample-requests``' default."""
        from_env = os.environ.get("INFER_TINKER_API_KEYS", "").split(",")
        keys = [k.strip() for k in [*(args.tinker_api_key or []), *from_env] if k.strip()]
        return cls(
            enabled=args.tinker,
            checkpoint_dir=args.checkpoint_dir,
            tinker_api_keys=frozenset(keys) if keys else None,
            tinker_aliases=tuple(args.tinker_alias or ()),
            limits=tinker_limits(args, max_num_seqs),
        )


def add_tinker_limit_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tinker-max-runs-per-key",
        type=int,
        default=_DEFAULTS.max_runs_per_key,
        help="training runs one API key may have loaded at once (default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-lora-rank",
        type=int,
        default=_DEFAULTS.max_lora_rank,
        help="the largest LoRA rank create_model accepts (default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-tokens-per-request",
        type=int,
        default=_DEFAULTS.max_tokens_per_request,
        help="tokens in one forward_backward request; the SDK is told to chunk below it "
        "(default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-pending-requests",
        type=int,
        default=_DEFAULTS.max_pending_requests,
        help="requests of one run waiting for their turn; beyond: HTTP 429, which the SDK "
        "retries (default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-pending-mib",
        type=int,
        default=_DEFAULTS.max_pending_bytes >> 20,
        help="their estimated payload, MiB per run (default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-seq-ahead",
        type=int,
        default=_DEFAULTS.max_seq_ahead,
        help="how far beyond the next expected seq_id a request may be numbered; beyond: "
        "HTTP 400 (default %(default)s)",
    )
    group.add_argument(
        "--tinker-max-sample-requests",
        type=int,
        default=None,
        help="Tinker sampling requests in the engine at once, tenants taking turns "
        "(default: --max-batch-size)",
    )
    group.add_argument(
        "--tinker-max-recorded-tokens",
        type=int,
        default=_DEFAULTS.max_recorded_tokens,
        help="tokens of sampled sequences kept for stable_reinforce training "
        "(record_stability_info), in all; beyond it the least recently used are dropped "
        "(default %(default)s)",
    )


def tinker_limits(args: argparse.Namespace, max_num_seqs: int) -> TinkerLimits:
    """The limits the flags ask for (``InvalidParameterError`` naming a bad one)."""
    sample = args.tinker_max_sample_requests
    values = {
        "max_runs_per_key": args.tinker_max_runs_per_key,
        "max_lora_rank": args.tinker_max_lora_rank,
        "max_tokens_per_request": args.tinker_max_tokens_per_request,
        "max_pending_requests": args.tinker_max_pending_requests,
        "max_pending_bytes": args.tinker_max_pending_mib << 20,
        "max_seq_ahead": args.tinker_max_seq_ahead,
        "max_sample_requests": max_num_seqs if sample is None else sample,
        "max_recorded_tokens": args.tinker_max_recorded_tokens,
    }
    for name, value in values.items():
        if value < 1:
            flag = "tinker_max_pending_mib" if name == "max_pending_bytes" else f"tinker_{name}"
            raise InvalidParameterError(flag, f"must be at least 1, got {value}")
    return TinkerLimits(**values)
