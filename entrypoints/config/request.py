"""``infer serve`` flags for the limits on one request to the OpenAI endpoints and
``/v1/generate`` (fields of :class:`EngineConfig`), and for preparing requests off the loop."""

import argparse
from typing import Any

from domain.config import EngineConfig

_DEFAULTS = EngineConfig()


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (beyond them: HTTP 400 naming the field)")
    group.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=_DEFAULTS.max_prompt_bytes,
        help="UTF-8 size of one prompt, or of a chat's messages together, checked before "
        "tokenizing (default %(default)s)",
    )
    group.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=_DEFAULTS.max_prompts_per_request,
        help="prompts in one /v1/completions request (default %(default)s; never more than "
        "--max-batch-size + --max-waiting-requests)",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=_DEFAULTS.max_n,
        help="choices per prompt (`n`) on the OpenAI endpoints; each choice is a request "
        "counted against --max-batch-size + --max-waiting-requests (default %(default)s)",
    )
    group.add_argument(
        "--max-stop-strings",
        type=int,
        default=_DEFAULTS.max_stop_strings,
        help="entries in `stop`, and in `stop_token_ids` (default %(default)s)",
    )
    group.add_argument(
        "--max-stop-bytes",
        type=int,
        default=_DEFAULTS.max_stop_bytes,
        help="UTF-8 size of all stop strings together (default %(default)s)",
    )
    group.add_argument(
        "--prepare-threads",
        type=int,
        default=_DEFAULTS.prepare_threads,
        help="threads tokenizing prompts and rendering chats off the event loop; more "
        "requests wait their turn (default %(default)s)",
    )
    group.add_argument(
        "--trust-chat-special-tokens",
        action="store_true",
        help="parse special-token text (<|im_start|>) inside chat messages as control tokens "
        "(default: plain text, so a message cannot forge a turn; for trusted clients only)",
    )


def request_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as :class:`~entrypoints.config.engine.EngineSettings` keyword arguments
    (named as in :class:`EngineConfig`, which validates them)."""
    return {
        "max_prompt_bytes": args.max_prompt_bytes,
        "max_prompts_per_request": args.max_prompts_per_request,
        "max_n": args.max_n,
        "max_stop_strings": args.max_stop_strings,
        "max_stop_bytes": args.max_stop_bytes,
        "prepare_threads": args.prepare_threads,
        "trust_chat_special_tokens": args.trust_chat_special_tokens,
    }
