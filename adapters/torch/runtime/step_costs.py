"""What the runner's steps cost on this machine by shape, for speculation to decide per
step what to draft (:class:`domain.speculation.StepCosts`).

A step of ``b`` decode rows plus ``d`` draft rows is timed on the runner itself — the
model, its kernel choices (``adapters/torch/cpu/tuning.py``), the verification and the
sampler, all as serving runs them — for ``b`` in 1, 2, 4, ... up to ``--max-num-seqs``
(and 64) and ``d`` in 0 .. k and b, 2b, .. kb (k: ``num_speculative_tokens``), each shape in turn
within a round (so that a drift of the machine's speed hits every shape alike), rounds
repeated, each shape's time its fastest. Sequences count ``CONTEXT`` positions each
(zeroed KV in blocks of the pool, before the engine has any request). A shape measured
slower than ``BUDGET_S`` allows for the rounds left stops the larger ones: steps of more
sequences then draft nothing.

The result is cached — unless this process's threads waited for a CPU more than ``BUSY``
of the time, another process keeping the cores busy (then it serves this run only and the
next start measures again) — per CPU, torch, thread count, model, dtype, the kernel
tuning's file and these shapes, under ``<cache>/tuning/steps-*.json``: the first start
on a machine measures (5-7 s on the default model, 2 vCPUs), later ones read it; ``infer
build-kernels`` measures ahead and ``--retune`` again.
"""

import hashlib
import json
import math
import os
import time
from pathlib import Path

import structlog
import torch

from adapters.torch.cpu.build import kernel_cache_dir
from adapters.torch.cpu.timing import waited_ms
from adapters.torch.cpu.tuning import cpu_name, isa_flags, linear_shapes, tuning_path
from adapters.torch.runtime.runner import TorchModelRunner
from domain.config import EngineConfig
from domain.request import Request
from domain.sampling import SamplingParams
from domain.scheduler import SchedulerOutput
from domain.scheduler.outputs import ScheduledChunk
from domain.speculation import StepCosts

log = structlog.get_logger(__name__)
VERSION = 2  # 2: one-call decode stack and bf16 panels (one-row steps ~25 % faster)
CONTEXT = 64  # positions before each decode row
SEQUENCES = (1, 2, 4, 8, 16, 32, 64)
ROUNDS = 3
BUDGET_S = 8.0  # for every round of every shape (one start's cost, the first on a machine)
# This process's threads waited for a CPU more than this share of the measurement's wall
# time (Linux's schedstat, summed over threads): another process was busy, not cached.
BUSY = 0.1
_ID = "step-cost-"


def step_costs(
    runner: TorchModelRunner, config: EngineConfig, model_key: str, *, force: bool = False
) -> StepCosts | None:
    """The runner's step costs (cached; ``force``: measured again), or None where
    speculation is off or drafts from a draft model (which costs forwards of its own)."""
    spec = config.speculative_config
    if spec is None or spec.method == "draft_model":
        return None
    k = spec.num_speculative_tokens
    if _room(config, k)[1] < 1:
        return None  # a pool too small for one measured sequence: the fallback rule
    path = _path(runner, config, model_key, k)
    if not force and path.is_file():
        try:
            cached = json.loads(path.read_text())
            return StepCosts({int(b): [tuple(p) for p in ps] for b, ps in cached.items()})
        except (OSError, ValueError, TypeError):
            log.warning("step costs unreadable: measured again", path=str(path))
    started, waited = time.perf_counter(), sum(waited_ms())
    costs = measure(runner, config, k)
    busy = (sum(waited_ms()) - waited) / ((time.perf_counter() - started) * 1e3)
    if busy > BUSY:  # another process had the cores: fine for this run, not for good
        log.warning(
            "step costs measured while other processes kept the CPU busy: not cached, "
            "measured again at the next start (or `infer build-kernels --retune`)",
            waited_share=round(busy, 2),
        )
        return costs
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # an interrupted write leaves no file
    partial.write_text(json.dumps({str(b): ps for b, ps in costs.ms.items()}))
    partial.replace(path)
    return costs


def measure(runner: TorchModelRunner, config: EngineConfig, k: int) -> StepCosts:
    """Time each shape (see the module's doc) on ``runner`` and return the fastest of each."""
    started = time.perf_counter()
    per_sequence, most = _room(config, k)
    vocab = runner.model.config.vocab_size
    ms: dict[int, list[tuple[int, float]]] = {}
    for b in (b for b in SEQUENCES if b <= most):
        requests = [_request(i, vocab) for i in range(b)]
        tables = [tuple(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(b)]
        _zero(runner, b * per_sequence)
        shapes = sorted({*range(k + 1), *(b * j for j in range(1, k + 1))})
        steps = {d: _step(requests, tables, d, vocab) for d in shapes}
        times = {d: math.inf for d in shapes}
        for round_ in range(ROUNDS + 1):  # the first warms each shape up
            for d, step in steps.items() if round_ % 2 == 0 else reversed(steps.items()):
                start = time.perf_counter()
                runner.execute(step)
                if round_:
                    times[d] = min(times[d], (time.perf_counter() - start) * 1e3)
        runner.release([r.request_id for r in requests])
        ms[b] = [(d, round(times[d], 4)) for d in shapes]
        spent = time.perf_counter() - started
        if spent + 2 * (ROUNDS + 1) * sum(times.values()) / 1e3 > BUDGET_S:
            break  # twice the sequences would not fit in the budget
    log.info(
        "step costs measured",
        sequences=max(ms),
        one_row_ms=ms[1][0][1],
        drafts_ratio={d: round(t / ms[1][0][1], 3) for d, t in ms[1][1:]},
        wall_s=round(time.perf_counter() - started, 1),
    )
    return StepCosts(ms)


def _request(i: int, vocab: int) -> Request:
    tokens = [(7919 * (i + j) + 13) % vocab for j in range(CONTEXT + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    return Request(f"{_ID}{i}", tokens[:-1], params, 0.0, generated_token_ids=tokens[-1:])


def _step(
    requests: list[Request], tables: list[tuple[int, ...]], drafts: int, vocab: int
) -> SchedulerOutput:
    """One decode row per request and ``drafts`` draft rows shared out evenly."""
    b = len(requests)
    chunks = []
    for i, (request, table) in enumerate(zip(requests, tables, strict=True)):
        n = drafts // b + (1 if i < drafts % b else 0)
        guessed = tuple((31 * (i + j) + 101) % vocab for j in range(n))
        chunks.append(ScheduledChunk(request, CONTEXT, 1, table, guessed))
    return SchedulerOutput(chunks)


def _room(config: EngineConfig, k: int) -> tuple[int, int]:
    """Blocks per measured sequence, and the most sequences measured: what
    ``--max-num-seqs`` lets run, ``SEQUENCES`` goes up to and the pool holds."""
    per_sequence = math.ceil((CONTEXT + 1 + k) / config.kv_block_size)
    room = config.kv_blocks // per_sequence
    return per_sequence, min(max(SEQUENCES), room, config.max_num_seqs)


def _zero(runner: TorchModelRunner, blocks: int) -> None:
    """Zero the KV the sequences read (the pool may be uninitialized memory)."""
    with torch.inference_mode():
        runner.cache.k[:, :blocks].zero_()
        runner.cache.v[:, :blocks].zero_()


def _path(runner: TorchModelRunner, config: EngineConfig, model_key: str, k: int) -> Path:
    tuning = tuning_path(linear_shapes(runner.model.config))
    tuned = hashlib.sha256(tuning.read_bytes()).hexdigest()[:16] if tuning.is_file() else ""
    weight = runner.model.embed_tokens.weight
    key = json.dumps(
        [
            VERSION,
            cpu_name(),
            isa_flags(),
            torch.__version__,
            torch.get_num_threads(),
            str(weight.device),
            str(weight.dtype),
            model_key,
            tuned,
            k,
            config.kv_block_size,
            _room(config, k)[1],
            config.batch_invariant,
            CONTEXT,
            SEQUENCES,
            ROUNDS,
        ]
    )
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return kernel_cache_dir().parent / "tuning" / f"steps-{name}.json"
