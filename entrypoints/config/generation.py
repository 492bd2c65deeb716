"""``infer serve`` flags for what the server decides about a request's generation
(:class:`GenerationSettings`): its default sampling parameters, in vLLM's spelling
(``--generation-config``, ``--override-generation-config``), and the cap on one request's
output tokens (``--max-output-tokens``; a tenant's ``max_output_tokens`` in the keys file
replaces it). See :mod:`application.serving.generation`."""

import argparse
import json
from dataclasses import dataclass

from application.serving.generation import DEFAULTABLE, MAX_NEW_TOKENS, GenerationDefaults
from domain.errors import InvalidParameterError

# The seed's suggested server-side output clamp (docs/operations.md: limits).
DEFAULT_MAX_OUTPUT_TOKENS = 1024
MODES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationSettings:
    """``generation_config``: where the default sampling parameters come from: ``auto``
    (the model's ``generation_config.json``), ``vllm`` (none: the API's own defaults), or
    a folder holding a ``generation_config.json``; ``override_generation_config``: a JSON
    object of fields over them (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``max_new_tokens``: a chat's length when it asks none);
    ``max_output_tokens``: the most tokens one request may generate (0: no cap, what the
    context leaves)."""

    generation_config: str = "auto"
    override_generation_config: str | None = None
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        if self.max_output_tokens < 0:
            raise InvalidParameterError(
                "max_output_tokens", f"must be >= 0 (0: no cap), got {self.max_output_tokens}"
            )
        try:
            GenerationDefaults.of(self.overrides())  # each override known and in range
        except InvalidParameterError as e:
            if e.param == "override_generation_config":
                raise
            raise InvalidParameterError("override_generation_config", str(e)) from None

    def overrides(self) -> dict[str, object]:
        """``--override-generation-config`` as an object (``InvalidParameterError`` naming
        the flag when it is not one of known fields)."""
        if self.override_generation_config is None:
            return {}
        try:
            value = json.loads(self.override_generation_config)
        except ValueError as e:
            raise InvalidParameterError("override_generation_config", f"not JSON: {e}") from None
        if not isinstance(value, dict):
            raise InvalidParameterError("override_generation_config", "must be a JSON object")
        unknown = sorted(set(value) - {*DEFAULTABLE, MAX_NEW_TOKENS})
        if unknown:
            known = ", ".join((*DEFAULTABLE, MAX_NEW_TOKENS))
            raise InvalidParameterError(
                "override_generation_config", f"unknown field {unknown[0]!r}: one of {known}"
            )
        return value

    @property
    def cap(self) -> int | None:
        return self.max_output_tokens or None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GenerationSettings":
        return cls(
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config,
            max_output_tokens=args.max_output_tokens,
        )


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    defaults = GenerationSettings()
    group = parser.add_argument_group("generation defaults and limits")
    group.add_argument(
        "--generation-config",
        default=defaults.generation_config,
        metavar="{auto,vllm,FOLDER}",
        help="default sampling parameters for requests that leave them out: auto (the "
        "model's generation_config.json), vllm (none: the API's defaults), or a folder with "
        "a generation_config.json (default %(default)s)",
    )
    group.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="default sampling parameters over --generation-config's, as a JSON object: "
        f"{', '.join((*DEFAULTABLE, MAX_NEW_TOKENS))} "
        '(e.g. \'{"temperature": 0.6, "top_p": 0.95}\')',
    )
    group.add_argument(
        "--max-output-tokens",
        type=int,
        default=defaults.max_output_tokens,
        help="the most tokens one request may generate: a request asking more, or none, "
        "runs to it (finish_reason length; the reply's x-infer-max-output-tokens header "
        "names it); a tenant's max_output_tokens in the keys file replaces it "
        "(0: no cap; default %(default)s)",
    )
