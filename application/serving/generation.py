"""The server's side of a request's sampling: the defaults a request that leaves a field out
gets (vLLM's ``--generation-config`` / ``--override-generation-config``: the model's
``generation_config.json``, then the operator's overrides) and the cap on the tokens one
request may generate (``--max-output-tokens``, or the tenant's ``max_output_tokens`` in the
keys file, which replaces the server's for that tenant).

A request that asks for more than the cap, or for nothing (a chat without ``max_tokens``),
runs to the cap: its output ends with ``finish_reason: length`` and the reply carries the
cap in ``x-infer-max-output-tokens``."""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams

# The sampling fields a generation config may default (vLLM's), by SamplingParams' names.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json's name for the default output length (vLLM reads it as max_tokens).
MAX_NEW_TOKENS = "max_new_tokens"
OUTPUT_CAP_HEADER = "x-infer-max-output-tokens"


@dataclass(frozen=True)
class GenerationDefaults:
    """``sampling``: a value for each of :data:`DEFAULTABLE` the model or the operator set
    (a request's own value wins); ``max_tokens``: a chat's output length when it asks none
    (None: what the context leaves); ``max_output_tokens``: the server's cap (None: none)."""

    sampling: Mapping[str, float | int] = field(default_factory=dict)
    max_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        """Each value in its range, else ``InvalidParameterError`` naming the field."""
        unknown = sorted(set(self.sampling) - set(DEFAULTABLE))
        if unknown:
            known = ", ".join((*DEFAULTABLE, MAX_NEW_TOKENS))
            raise InvalidParameterError(unknown[0], f"unknown field: one of {known}")
        lengths = {MAX_NEW_TOKENS: self.max_tokens, "max_output_tokens": self.max_output_tokens}
        for name, value in lengths.items():
            if value is not None and value < 1:
                raise InvalidParameterError(name, f"must be at least 1, got {value}")
        SamplingParams(**self.sampling)  # type: ignore[arg-type]

    @classmethod
    def of(
        cls, config: Mapping[str, object], max_output_tokens: int | None = None
    ) -> "GenerationDefaults":
        """From a generation config's fields (the model's ``generation_config.json`` with
        the overrides over it): the sampling fields and ``max_new_tokens``; the others
        (token ids, ``do_sample``...) are not sampling defaults and are left out."""
        sampling: dict[str, float | int] = {}
        for name in DEFAULTABLE:
            value = config.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidParameterError(
                    "generation_config", f"{name} must be a number, got {value!r}"
                )
            sampling[name] = int(value) if name == "top_k" else float(value)
        length = config.get(MAX_NEW_TOKENS)
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
            raise InvalidParameterError(
                "generation_config", f"{MAX_NEW_TOKENS} must be an integer, got {length!r}"
            )
        return cls(sampling, length, max_output_tokens)

    def applied(self, params: SamplingParams, unset: frozenset[str]) -> SamplingParams:
        """``params`` with the defaults of the fields the request left out (``unset``)."""
        values = {name: v for name, v in self.sampling.items() if name in unset}
        return replace(params, **values) if values else params  # type: ignore[arg-type]

    def cap(self, tenant_cap: int | None) -> int | None:
        """The output cap for a caller: its tenant's, else the server's (None: none)."""
        return tenant_cap if tenant_cap is not None else self.max_output_tokens
