"""``infer serve`` flags for the Tinker API's per-key limits (:class:`TinkerLimits`)."""

import argparse

from domain.errors import InvalidParameterError
from domain.training import TinkerLimits

_DEFAULTS = TinkerLimits()


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


def tinker_limits(args: argparse.Namespace, max_batch_size: int) -> TinkerLimits:
    """The limits the flags ask for (``InvalidParameterError`` naming a bad one)."""
    sample = args.tinker_max_sample_requests
    values = {
        "max_runs_per_key": args.tinker_max_runs_per_key,
        "max_lora_rank": args.tinker_max_lora_rank,
        "max_tokens_per_request": args.tinker_max_tokens_per_request,
        "max_pending_requests": args.tinker_max_pending_requests,
        "max_pending_bytes": args.tinker_max_pending_mib << 20,
        "max_seq_ahead": args.tinker_max_seq_ahead,
        "max_sample_requests": max_batch_size if sample is None else sample,
    }
    for name, value in values.items():
        if value < 1:
            flag = "tinker_max_pending_mib" if name == "max_pending_bytes" else f"tinker_{name}"
            raise InvalidParameterError(flag, f"must be at least 1, got {value}")
    return TinkerLimits(**values)
