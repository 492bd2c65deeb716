"""What this CPU can do at best on bench_vs_llamacpp's workload: the arithmetic floors.

Measures the machine (float32 and bfloat16 GEMM peaks through torch, 2048^3, best of 5;
memory read bandwidth, a 256 MiB sum, and STREAM's triad ``a = b + s * c`` over three
256 MiB float32 arrays (24 bytes moved per element), best of 5 each; all at the current
thread count) and counts the
work of ``bench_vs_llamacpp.py``'s levels for the model: its prompts tokenized, the FLOPs
of every linear (2 per weight per token; the LM head only where a token is sampled) and of
attention (4 * layers * q_size per key read), the quantized weights' bytes. Then:

- the most output tok/s a level can reach: all its FLOPs at the measured GEMM peak (the
  faster of float32 and bfloat16: what ``--dtype auto`` runs the tiles in), and at twice
  it (an upper bound for any int8 GEMM: ``vpdpbusd`` retires at most twice the
  multiply-adds of a bf16 ``vdpbf16ps`` per cycle);
- the least TTFT p50 at c concurrent prompts: the k-th first token needs k prompts
  prefilled (shortest first, nothing else running);
- the single-stream decode ceiling: the weights read once per token at the measured
  bandwidth (a lower bound on time, nothing computed).

Usage:

    .venv/bin/python benchmarks/cpu_floor.py [--model X.gguf] [--prompt-words 100]
        [--output-len 64] [--concurrency 1,4,16,64] [--max-requests 64] [--min-requests 8]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from adapters.torch.cpu.tuning import cpu_name, isa_flags  # noqa: E402
from adapters.torch.models.config import ModelConfig  # noqa: E402
from adapters.torch.quant import QUANTIZED_FILE  # noqa: E402
from benchmarks import bench_vs_llamacpp as bl  # noqa: E402
from entrypoints.config import ServerConfig  # noqa: E402
from entrypoints.container import create_container  # noqa: E402

MIB = 1 << 20


def gemm_peak(size: int = 2048, runs: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of one ``size``-cubed matmul in ``dtype``, best of ``runs``."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(runs))
    return 2 * size**3 / best / 1e9


def read_bandwidth(mib: int = 256, runs: int = 5) -> float:
    """GB/s of one sum over ``mib`` MiB of float32, best of ``runs``."""
    x = torch.ones(mib * MIB // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(runs))
    return mib * MIB / best / 1e9


def triad_bandwidth(mib: int = 256, runs: int = 5) -> float:
    """STREAM's triad, ``a = b + 3 c`` over ``mib`` MiB float32 arrays: GB/s moved (two
    read, one written), best of ``runs``."""
    b, c = torch.ones(mib * MIB // 4), torch.ones(mib * MIB // 4)
    a = torch.empty_like(b)
    torch.add(b, c, alpha=3.0, out=a)
    best = min(_timed(lambda: torch.add(b, c, alpha=3.0, out=a)) for _ in range(runs))
    return 3 * mib * MIB / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linear_params(c: ModelConfig) -> tuple[int, int]:
    """Weights of the decoder layers' linears, and of the LM head."""
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size
    per_layer += 3 * c.intermediate_size * c.hidden_size
    return c.num_layers * per_layer, c.vocab_size * c.hidden_size


def prefill_flops(c: ModelConfig, tokens: int) -> float:
    """One prompt of ``tokens``: every linear on every token, causal attention, the LM head
    on the last token only."""
    layers, head = linear_params(c)
    attention = 4 * c.num_layers * c.q_size * tokens * (tokens + 1) / 2
    return 2 * layers * tokens + attention + 2 * head


def decode_flops(c: ModelConfig, context: int) -> float:
    """One decoded token at ``context`` keys."""
    layers, head = linear_params(c)
    return 2 * (layers + head) + 4 * c.num_layers * c.q_size * context


def floors(
    c: ModelConfig, prompts: list[int], concurrency: int, output_len: int, peak: float
) -> tuple[float, float, float]:
    """For ``prompts`` (token counts) sent as bench_vs_llamacpp sends them, at most
    ``concurrency`` in flight, at ``peak`` FLOP/s: (most output tok/s, least TTFT p50 of
    the first ``concurrency`` prompts, which arrive together, in s; least TTFT p50 of all,
    in s, where a later prompt's bound is its own prefill alone)."""
    total = sum(prefill_flops(c, p) for p in prompts)
    total += sum(decode_flops(c, p + i) for p in prompts for i in range(1, output_len))
    seconds = total / peak
    done, first_wave = 0.0, []
    for p in sorted(prompts[:concurrency]):  # shortest first: the least p50
        done += prefill_flops(c, p)
        first_wave.append(done / peak)
    later = [prefill_flops(c, p) / peak for p in prompts[concurrency:]]
    return (
        len(prompts) * output_len / seconds,
        statistics.median(first_wave),
        statistics.median(first_wave + later),
    )


def weights_read(folder: Path, config: ModelConfig, mib: float | None) -> float:
    """Bytes of weights a decode step reads: ``mib`` if given, else the converted GGUF's
    quantized blocks (what ``--quantization gguf`` serves), else the linears in float32."""
    if mib is not None:
        return mib * MIB
    blocks = folder / QUANTIZED_FILE
    if blocks.is_file():
        return float(blocks.stat().st_size)
    return 4.0 * sum(linear_params(config))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--weights-mib",
        type=float,
        default=None,
        help="weights read per token (default: a GGUF's quantized blocks, else float32)",
    )
    args = p.parse_args()
    model = args.model or bl.default_model()
    container = create_container(ServerConfig.for_model(model))
    folder = container.backend.resolved_model().path
    config = ModelConfig.from_folder(folder)
    tokenizer = container.backend.tokenizer()
    fp32, bf16 = gemm_peak() * 1e9, gemm_peak(dtype=torch.bfloat16) * 1e9
    peak = max(fp32, bf16)
    bandwidth, triad = read_bandwidth() * 1e9, triad_bandwidth() * 1e9
    print(f"CPU: {cpu_name()}; ISA: {' '.join(isa_flags())}; {torch.get_num_threads()} threads")
    print(
        f"GEMM peak: float32 {fp32 / 1e9:.1f} GFLOP/s, bfloat16 {bf16 / 1e9:.1f} GFLOP/s; "
        f"memory: read {bandwidth / 1e9:.1f} GB/s, STREAM triad {triad / 1e9:.1f} GB/s"
    )
    layers, head = linear_params(config)
    print(f"model {model}: {layers / 1e6:.1f} M layer weights, {head / 1e6:.1f} M LM head")
    weights = weights_read(folder, config, args.weights_mib)
    print(
        f"single-stream decode ceiling: {weights / MIB:.0f} MiB of weights per token at "
        f"{bandwidth / 1e9:.1f} GB/s = {bandwidth / weights:.0f} tok/s"
    )
    print(
        "\n| c | requests | prompt tokens (mean) | max tok/s: GEMM peak | 2x (int8 bound) "
        "| min TTFT p50, first c: GEMM peak | 2x | min TTFT p50, all: GEMM peak | 2x |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        n = bl.requests_for(c, args.max_requests, args.min_requests)
        prompts = [
            len(tokenizer.encode(bl.prompt_text(f"{args.seed}-c{c}-{i}", args.prompt_words)))
            for i in range(n)
        ]
        one = floors(config, prompts, c, args.output_len, peak)
        two = floors(config, prompts, c, args.output_len, 2 * peak)
        print(
            f"| {c} | {n} | {statistics.mean(prompts):.0f} | {one[0]:.0f} | {two[0]:.0f} "
            f"| {one[1]:.2f} | {two[1]:.2f} | {one[2]:.2f} | {two[2]:.2f} |"
        )


if __name__ == "__main__":
    main()
