"""Time per decode step (TPOT) at fixed batch sizes through the in-process engine.

For each batch size ``B``: ``B`` prompts of ``--prompt-len`` random token ids, each
generating ``--new-tokens`` (``ignore_eos``), all submitted at once; the same prompts with
one new token time the prefill, and TPOT = (full - prefill) / (new tokens - 1): the
engine's decode step at ``B`` rows, host and device together, as a client sees it.
``--profile`` adds, for ``B`` = 1, the CUDA kernels launched per decode step and the
device's busy time per step against the step's wall time (torch.profiler).

Usage:
    .venv/bin/python benchmarks/bench_decode_step.py --model dummy:Qwen3-0.6B --device cuda
        [--batch-sizes 1,16,64,256] [--prompt-len 32] [--new-tokens 64] [--profile]
        [--result-json PATH]
"""

import json
import platform
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.bench_offline import engine_options  # noqa: E402
from domain.config import EngineConfig  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from entrypoints.inprocess import LLM  # noqa: E402


def main() -> None:
    p = engine_options(__doc__)
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        engine=EngineConfig(
            max_model_len=args.prompt_len + args.new_tokens + 16,
            max_num_seqs=max(sizes),
            max_waiting_requests=max(64, max(sizes)),
            enforce_eager=args.enforce_eager,
            max_num_batched_tokens=max(2048, max(sizes) * args.prompt_len),
        ),
    )
    vocab = min(10_000, llm.tokenizer.vocab_size)
    rng = random.Random(0)

    def run(batch: int, new_tokens: int) -> float:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        _sync()
        start = time.perf_counter()
        llm.generate(prompts, params)
        _sync()
        return time.perf_counter() - start

    run(2, 4)  # warm-up
    rows = []
    for batch in sizes:
        run(batch, 4)
        prefill = min(run(batch, 1) for _ in range(2))
        full = min(run(batch, args.new_tokens) for _ in range(2))
        tpot_ms = (full - prefill) / (args.new_tokens - 1) * 1000
        row = {
            "batch": batch,
            "tpot_ms": round(tpot_ms, 3),
            "decode_tok_s": round(batch * 1000 / tpot_ms, 1),
            "prefill_s": round(prefill, 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result: dict[str, object] = {
        "model": args.model,
        "device": _device_name(),
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "enforce_eager": args.enforce_eager,
        "rows": rows,
    }
    if args.profile and torch.cuda.is_available():
        result["profile"] = _profile(llm, vocab, args.prompt_len)
        print(json.dumps(result["profile"]), flush=True)
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))


def _profile(llm: LLM, vocab: int, prompt_len: int) -> dict[str, float]:
    """Kernels launched and device-busy time per decode step at one row."""
    from torch.profiler import ProfilerActivity, profile

    prompt = [[random.randrange(vocab) for _ in range(prompt_len)]]
    steps = 32
    llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as short:
        llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as full:
        llm.generate(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        _sync()
    wall = time.perf_counter() - start

    def kernels(prof: "profile") -> tuple[int, float]:
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        return len(events), sum(e.device_time for e in events) / 1000  # us -> ms

    n_short, t_short = kernels(short)
    n_full, t_full = kernels(full)
    return {
        "kernels_per_step": round((n_full - n_short) / steps, 1),
        "gpu_ms_per_step": round((t_full - t_short) / steps, 3),
        "wall_ms_per_step_profiled": round(wall * 1000 / (steps + 1), 3),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
