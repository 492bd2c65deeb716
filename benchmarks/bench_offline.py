"""nano-vllm's offline throughput workload through the in-process engine (``LLM.generate``).

The workload of nano-vllm's ``bench.py``: ``--num-seqs`` sequences (256) of random token
ids, input and output lengths each uniform in ``[--min-len, --max-len]`` (100-1,024),
``ignore_eos`` so every sequence runs its full output length; all submitted at once.
Reported: output tokens per second over the whole run (wall clock, after a warm-up
request), and the total tokens.

Usage:
    .venv/bin/python benchmarks/bench_offline.py --model dummy:Qwen3-0.6B --device cuda
        [--num-seqs 256] [--min-len 100] [--max-len 1024] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192] [--dtype bfloat16] [--result-json PATH]
"""

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from domain.config import EngineConfig  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from entrypoints.inprocess import LLM  # noqa: E402


def engine_options(doc: str) -> argparse.ArgumentParser:
    """A parser (described by ``doc``'s first line) with the in-process engine's options:
    ``--model``, ``--dtype``, ``--device``, ``--enforce-eager``, ``--result-json``; shared
    with bench_decode_step.py."""
    p = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    p.add_argument("--model", default="dummy:Qwen3-0.6B")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--result-json", type=Path, default=None)
    return p


def main() -> None:
    p = engine_options(__doc__)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        engine=EngineConfig(
            max_model_len=2 * args.max_len,
            max_num_seqs=args.max_num_seqs,
            max_waiting_requests=max(64, args.num_seqs),
            enforce_eager=args.enforce_eager,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
    )
    vocab = min(10_000, llm.tokenizer.vocab_size)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_seqs)
    ]
    params = [
        SamplingParams(
            temperature=0.6, ignore_eos=True, max_tokens=rng.randint(args.min_len, args.max_len)
        )
        for _ in range(args.num_seqs)
    ]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(r.token_ids) for r in results)
    assert output_tokens == sum(q.max_tokens for q in params), "a sequence stopped early"
    input_tokens = sum(len(q) for q in prompts)
    row = {
        "model": args.model,
        "device": _device_name(args.device),
        "num_seqs": args.num_seqs,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": round(elapsed, 2),
        "output_tok_s": round(output_tokens / elapsed, 1),
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    print(
        f"{args.model} on {row['device']}: {args.num_seqs} seqs, {input_tokens} prompt + "
        f"{output_tokens} output tokens in {elapsed:.1f} s -> "
        f"{row['output_tok_s']:.0f} output tok/s"
    )
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(row, indent=1))


def _device_name(device: str | None) -> str:
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
