"""SamplingController: sampling sessions and ``asample`` requests.

A sampler samples a base model with optional adapter weights: a saved checkpoint
(``model_path``), an unnamed snapshot of a run's weights (``save_weights_for_sampler``
without a name), or a live run's current weights. Samples run concurrently through the
SamplingBackend; their futures resolve to a :class:`TinkerSampleResult`.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from application.tinker.checkpoints import CheckpointStore
from application.tinker.futures import Future, FutureStore
from application.tinker.training import TrainingController
from domain.sampling import MAX_PROMPT_TARGETS
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.ports import SamplingBackend
from domain.tinker.values import (
    PromptTable,
    SampleRequest,
    TinkerSampleResult,
    TinkerSamplingParams,
    TopK,
    WeightsSource,
)

MAX_SAMPLES = 128
MAX_TOPK = 20
MAX_TARGET_IDS = MAX_PROMPT_TARGETS  # target_prompt_logprobs' K: ids scored per position


@dataclass(eq=False)
class SamplerRecord:
    id: str
    owner: str
    session_id: str
    source: WeightsSource
    model_path: str | None = None
    scratch: Path | None = None  # an unnamed snapshot's folder, removed with the session
    requests: int = field(default=0)


@dataclass(frozen=True, slots=True)
class SamplerReady:
    """What an unnamed ``save_weights_for_sampler`` resolves to: the sampler made."""

    sampler_id: str


class SamplingController:
    def __init__(
        self,
        backend: SamplingBackend,
        training: TrainingController,
        checkpoints: CheckpointStore,
        futures: FutureStore,
        *,
        discard_folder: Callable[[Path], None],
    ) -> None:
        self.backend = backend
        self.training = training
        self.checkpoints = checkpoints
        self.futures = futures
        self._discard = discard_folder
        self._samplers: dict[str, SamplerRecord] = {}

    def source_for(
        self, owner: str, *, base_model: str | None, model_path: str | None
    ) -> WeightsSource:
        if model_path:
            record, folder = self.checkpoints.resolve(owner, model_path)
            return WeightsSource(record.base_model, path=folder)
        if base_model:
            return WeightsSource(self.training.base_model(base_model).name)
        raise InvalidTrainingRequest("give base_model or model_path")

    def create(
        self,
        owner: str,
        session_id: str,
        seq: int,
        source: WeightsSource,
        *,
        model_path: str | None = None,
        scratch: Path | None = None,
    ) -> SamplerRecord:
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self._samplers:
            raise InvalidTrainingRequest(
                f"sampling session {sampler_id!r} exists (sampling_session_seq_id reused)"
            )
        sampler = SamplerRecord(sampler_id, owner, session_id, source, model_path, scratch)
        self._samplers[sampler_id] = sampler
        return sampler

    def get(self, owner: str, sampler_id: str) -> SamplerRecord:
        sampler = self._samplers.get(sampler_id)
        if sampler is None or sampler.owner != owner:
            raise NotFoundError(f"no sampling session {sampler_id!r}")
        return sampler

    def source_of(self, sampler: SamplerRecord) -> WeightsSource:
        """What ``sampler`` samples now: its checkpoint must still exist (named by its
        ``tinker://`` path, never by where the server keeps it)."""
        if sampler.model_path is not None:
            return self.source_for(sampler.owner, base_model=None, model_path=sampler.model_path)
        return sampler.source

    def sample(
        self,
        owner: str,
        source: WeightsSource,
        prompt: Sequence[int],
        params: TinkerSamplingParams,
        num_samples: int,
        *,
        prompt_logprobs: bool,
        prompt_logprobs_last_n: int | None = None,
        topk_prompt: int = 0,
        topk_sample: int = 0,
        target_prompt: PromptTable | None = None,
        prompt_alt_k: int = 0,
    ) -> Future:
        """Samples; with ``prompt_logprobs_last_n`` only the last n prompt logprobs (and
        top-k rows) are reported (the others are None); ``target_prompt`` and
        ``prompt_alt_k`` cover the whole prompt."""
        last_n = prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise InvalidTrainingRequest("prompt_logprobs_last_n must be in 1..len(prompt)-1")
        if last_n is not None and not prompt_logprobs:
            raise InvalidTrainingRequest("prompt_logprobs_last_n needs prompt_logprobs")
        if not prompt:
            raise InvalidTrainingRequest("prompt: must hold at least one token")
        if target_prompt is not None:
            _check_targets(target_prompt, len(prompt))
        if not 1 <= num_samples <= MAX_SAMPLES:
            raise InvalidTrainingRequest(f"num_samples must be in 1..{MAX_SAMPLES}")
        _check_params(params)
        for name, k in (
            ("topk_prompt_logprobs", topk_prompt),
            ("topk_sample_logprobs", topk_sample),
            ("prompt_alt_tokens_k", prompt_alt_k),
        ):
            if not 0 <= k <= MAX_TOPK:
                raise InvalidTrainingRequest(f"{name} must be in 0..{MAX_TOPK}")
        if source.model_id is not None and not self.training.is_live(source.model_id):
            raise NotFoundError(f"training run {source.model_id!r} is no longer loaded")
        tokens = list(prompt)
        tenant = owner

        async def work() -> TinkerSampleResult:
            request = SampleRequest(
                tokens,
                params,
                num_samples,
                prompt_logprobs=prompt_logprobs or topk_prompt > 0,
                topk_prompt=topk_prompt,
                topk_sample=topk_sample,
                target_prompt=target_prompt,
                prompt_alt_k=prompt_alt_k,
                prompt_logprobs_last_n=prompt_logprobs_last_n,
            )
            result = await self.backend.sample(source, request, tenant=tenant)
            scored, alternatives = result.prompt_logprobs, result.topk_prompt
            if not prompt_logprobs:
                scored = None
            if prompt_logprobs_last_n is not None:
                cut = max(0, len(tokens) - prompt_logprobs_last_n)
                if scored is not None:
                    masked: list[float | None] = [None] * cut
                    scored = masked + scored[cut:]
                if alternatives is not None:
                    none: list[TopK | None] = [None] * cut
                    alternatives = none + alternatives[cut:]
            return replace(result, prompt_logprobs=scored, topk_prompt=alternatives)

        return self.futures.run(owner, "Sample", work)

    def end_session(self, session_id: str) -> None:
        for sampler_id in [s for s, v in self._samplers.items() if v.session_id == session_id]:
            sampler = self._samplers.pop(sampler_id)
            if sampler.scratch is not None:
                self._discard(sampler.scratch)

    def of_session(self, session_id: str) -> list[str]:
        return [s for s, v in self._samplers.items() if v.session_id == session_id]


def _check_params(p: TinkerSamplingParams) -> None:
    checks = [
        ("max_tokens", p.max_tokens >= 1, "must be at least 1"),
        ("temperature", p.temperature >= 0, "must be >= 0"),
        ("top_p", 0 < p.top_p <= 1, "must be in (0, 1]"),
        ("top_k", p.top_k == -1 or p.top_k >= 1, "must be -1 (off) or >= 1"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise InvalidTrainingRequest(f"sampling_params.{name} {why}, got {getattr(p, name)!r}")


def _check_targets(table: PromptTable, prompt_length: int) -> None:
    """``target_prompt_logprobs`` fits the prompt: ``[len(prompt) - 1, K]``, K within
    ``MAX_TARGET_IDS``, at least one id asked."""
    rows, width = table.shape
    if rows != prompt_length - 1:
        raise InvalidTrainingRequest(
            f"target_prompt_logprobs: shape {list(table.shape)} needs {prompt_length - 1} rows "
            "(len(prompt) - 1: row i scores prompt position i + 1)"
        )
    if width > MAX_TARGET_IDS:
        raise InvalidTrainingRequest(
            f"target_prompt_logprobs: {width} ids per position, at most {MAX_TARGET_IDS}"
        )
    if all(value == -1 for value in table.values):
        raise InvalidTrainingRequest("target_prompt_logprobs: asks for no id (every cell is -1)")
