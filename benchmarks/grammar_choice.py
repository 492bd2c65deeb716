"""llguidance vs xgrammar on the default model's tokenizer (SmolLM2, vocabulary 49152): which
of the structured-output test schemas (tests/structured_schemas.py) each compiles, the
compile time, and the per-token mask time while walking each schema's valid example token
by token (compact JSON). The numbers chose the grammar library (docs/openai.md, "Structured
outputs"). Both libraries must be installed (only llguidance is a dependency):

    .venv/bin/pip install xgrammar
    .venv/bin/python benchmarks/grammar_choice.py [--repeat 3]
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.weights import resolve_model
from benchmarks.bench_serving import machine_line
from tests.structured_schemas import SCHEMAS

VOCAB = 49152
EOS = 2  # <|im_end|>

# (compile(schema) -> state, walk(state, ids) -> per-token mask seconds)
Backend = tuple[Callable[[str], Any], Callable[[Any, list[int]], list[float]]]


def llguidance_backend(tokenizer_json: str) -> Backend:
    import llguidance
    import llguidance.torch as lt

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=[EOS])
    bitmask = lt.allocate_token_bitmask(1, VOCAB)

    def compile_(schema: str) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error)
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def walk(matcher: Any, ids: list[int]) -> list[float]:
        times = []
        for token in [*ids, EOS]:
            start = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            assert _allowed(bitmask, token), f"token {token} masked out"
            assert matcher.consume_token(token), matcher.get_error()
        return times

    return compile_, walk


def xgrammar_backend(folder: Path) -> Backend:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)

    def compile_(schema: str) -> Any:
        return xgrammar.GrammarMatcher(
            compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        )

    def walk(matcher: Any, ids: list[int]) -> list[float]:
        times = []
        for token in [*ids, EOS]:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
            assert _allowed(bitmask, token), f"token {token} masked out"
            assert matcher.accept_token(token)
        return times

    return compile_, walk


def _allowed(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def measure(name: str, backend: Backend, encode: Callable[[str], list[int]], repeat: int) -> None:
    compile_, walk = backend
    compiled, compile_ms, mask_us, failures = 0, [], [], []
    for case in SCHEMAS:
        schema = json.dumps(case.schema)
        ids = encode(json.dumps(case.example, separators=(",", ":")))
        try:
            for _ in range(repeat):
                start = time.perf_counter()
                state = compile_(schema)
                compile_ms.append((time.perf_counter() - start) * 1e3)
                mask_us += [t * 1e6 for t in walk(state, ids)]
            compiled += 1
        except Exception as e:  # a library's refusal or a mask that rejects the example
            failures.append(f"{case.name}: {str(e).splitlines()[0][:100]}")
    mask_us.sort()
    print(f"\n{name}: {compiled}/{len(SCHEMAS)} schemas compiled and walked")
    print(f"  compile ms: median {statistics.median(compile_ms):.2f}, max {max(compile_ms):.2f}")
    print(
        f"  mask us/token: median {statistics.median(mask_us):.0f}, "
        f"p99 {mask_us[int(len(mask_us) * 0.99)]:.0f}, max {mask_us[-1]:.0f}, "
        f"mean {statistics.fmean(mask_us):.0f} ({len(mask_us)} masks)"
    )
    for failure in failures:
        print(f"  FAILED {failure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="compiles and walks per schema")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    folder = resolve_model(None, progress=False).path
    tokenizer_json = (folder / "tokenizer.json").read_text()
    hf = Tokenizer.from_str(tokenizer_json)

    def encode(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False).ids)

    print(f"{machine_line()}; {len(SCHEMAS)} schemas")
    measure("llguidance", llguidance_backend(tokenizer_json), encode, args.repeat)
    try:
        measure("xgrammar", xgrammar_backend(folder), encode, args.repeat)
    except ImportError:
        print("\nxgrammar: not installed (pip install xgrammar)")


if __name__ == "__main__":
    main()
