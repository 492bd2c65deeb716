"""``infer`` command line: ``infer serve``, ``infer generate "prompt"``, ``infer key``, the
kernel commands. Standard output carries a command's result only (the generated text, a
key, a report); every log line, progress and timing goes to standard error. ``--help`` is
plain text (:class:`_PlainHelp` strips the reST markup of the help strings)."""

import argparse
import asyncio
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from dependency_injector import providers

from adapters.observability.logging import LEVELS, configure_logging
from adapters.torch.cpu.threads import set_threads
from adapters.torch.kv_sizing import (
    AUTO,
    CPU_AUTO_CAP,
    CPU_AUTO_FRACTION,
    CUDA_AUTO_FRACTION,
    KVCacheMemory,
    human_size,
    parse_kv_cache_memory,
)
from application.async_engine import AsyncEngine
from application.keys import hash_key, new_key
from application.request_ids import new_request_id
from domain.config import EngineConfig
from domain.errors import InferError, InvalidParameterError
from domain.sampling import SamplingParams
from entrypoints.access_flags import add_access_args, keyring_from_args, sighup_reloader
from entrypoints.container import DTYPES, QUANTIZATIONS, TOOL_CALL_PARSERS, create_container
from entrypoints.embedding_flags import add_embedding_args, embedding_limits, embedding_model
from entrypoints.model_flags import add_model_name_args, model_settings, served_model_name
from entrypoints.observability_flags import add_observability_args, observability_settings
from entrypoints.request_flags import add_request_limit_args, request_limits
from entrypoints.server import add_connection_args, connection_limits, run_server
from entrypoints.tinker_flags import add_tinker_limit_args, tinker_limits
from entrypoints.transport_flags import add_transport_args, transport_settings

QUANTIZATION_CHOICES = [q for q in QUANTIZATIONS if q is not None]
# vLLM's dtype names (`auto` is decided per machine: entrypoints.container.choose_dtype).
DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "float": "float32"}


DESCRIPTION = (
    "infer: an LLM inference server with its own PyTorch engine. 'infer serve' serves the "
    "OpenAI-compatible API, /v1/generate and the Tinker fine-tuning API; 'infer generate' "
    "writes one prompt's text to stdout."
)


# ``infer serve``'s --max-num-seqs by device: vLLM's 256 on a GPU; on a CPU 64, where the
# default model's aggregate throughput peaks on 2 vCPUs (benchmarks/README.md).
MAX_NUM_SEQS = {"cpu": 64, "cuda": 256}


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything logs: structlog unconfigured prints to stdout, the product's output.
    configure_logging()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except InvalidParameterError as e:  # named as the flag that sets it
        flag = f"--{e.param.replace('_', '-')}"
        known = any(flag in a.option_strings for a in _all_actions(parser))
        message = str(e).replace(e.param, flag, 1) if known else str(e)
        print(f"error: {message}", file=sys.stderr)
        return 2
    except InferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of every subcommand."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions.extend(sub._actions)
    return actions


# :class:`x`, :func:`~a.b.x` (shown as x), :ref:`title <target>` (shown as title)
_ROLE = re.compile(r":[\w:.-]+:`(~?)([^`<]*?)\s*(?:<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"`([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` without reStructuredText's inline markup: roles (``:class:`X```) and
    literals (````x````) become their text, interpreted text (```x```) is quoted."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    text = _LITERAL.sub(r"\1", text)
    return _INTERPRETED.sub(r"'\1'", text)


class _PlainHelp(argparse.HelpFormatter):
    """Descriptions and help strings printed as plain text (see :func:`plain_text`)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)


class _Parser(argparse.ArgumentParser):
    """A parser whose ``--help`` is plain text; its subcommands' parsers are of this class
    too (``add_subparsers`` makes parsers of the parser's own type)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _PlainHelp)
        super().__init__(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="infer", description=DESCRIPTION)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    _add_model_args(gen)
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user chat turn")
    _add_sampling_args(gen)
    gen.add_argument("--quiet", "-q", action="store_true", help="no timing summary on stderr")
    gen.add_argument(
        "--log-level",
        default="info",
        choices=LEVELS,
        help="log lines at this level and above, on stderr (default %(default)s)",
    )
    gen.add_argument(
        "--verbose",
        "-v",
        dest="log_level",
        action="store_const",
        const="debug",
        help="debug log lines too (--log-level debug)",
    )
    gen.set_defaults(func=_generate)
    kernels = sub.add_parser(
        "build-kernels",
        help="compile the CPU kernels this machine can run and measure what --dtype auto "
        "needs for the model, once (make setup does; otherwise the first model load does)",
    )
    kernels.add_argument("--model", default=None, help="model spec (default: the embedded one)")
    kernels.add_argument("--cache-dir", default=None, help="converted-weights cache")
    _add_threads_arg(kernels)
    kernels.set_defaults(func=_build_kernels)
    bench = sub.add_parser(
        "bench-kernels",
        help="time this CPU's kernel paths on a model's linear shapes and print what "
        "--dtype auto and the quantized kernel choose, and why",
    )
    bench.add_argument("--model", default=None, help="model spec (default: the embedded one)")
    bench.add_argument("--cache-dir", default=None, help="converted-weights cache")
    bench.add_argument("--force", action="store_true", help="measure again, ignoring the cache")
    _add_threads_arg(bench)
    bench.set_defaults(func=_bench_kernels)
    key = sub.add_parser("key", help="print a new API key and its line for --api-keys-file")
    key.add_argument("existing", nargs="?", help="hash this key instead of making one")
    key.set_defaults(func=_key)
    serve = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API, /v1/generate and the Tinker API"
    )
    serve.add_argument(
        "model_tag", nargs="?", default=None, help="the model, as `vllm serve MODEL` takes it"
    )
    _add_model_args(serve)
    # A server serves a GGUF model from its own quantized blocks on a CPU, as llama.cpp does
    # (1.9x the decode speed at one stream and 1.4x at 16 of its bf16 copy; docs/cpu.md).
    serve.set_defaults(quantization="auto")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--max-batch-size",
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"running requests at most (default: {MAX_NUM_SEQS['cpu']} on a CPU, "
        f"{MAX_NUM_SEQS['cuda']} on a GPU)",
    )
    serve.add_argument("--batching-mode", default="continuous", choices=["continuous", "static"])
    serve.add_argument("--max-waiting-requests", type=int, default=64, help="beyond: HTTP 503")
    serve.add_argument(
        "--max-seq-len", "--max-model-len", type=int, default=2048, help="prompt + output tokens"
    )
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse cached KV blocks of shared prefixes)",
    )
    kv_pool = serve.add_mutually_exclusive_group()
    kv_pool.add_argument(
        "--kv-cache-memory",
        type=_kv_cache_memory,
        default=None,
        metavar="SIZE|FRACTION|auto",
        help="KV cache budget: a size (512MiB, 4GiB, 2GB, bytes) or a fraction in (0, 1] "
        "(CUDA: of the device's memory, the model's share included, as vLLM's "
        "--gpu-memory-utilization; CPU: of the memory available now); the KV blocks fill it "
        f"(default auto: {CUDA_AUTO_FRACTION:g} on CUDA; on a CPU {CPU_AUTO_FRACTION:g} of "
        f"the memory available, at most {human_size(CPU_AUTO_CAP)})",
    )
    kv_pool.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV blocks in the pool (instead)"
    )
    serve.add_argument(
        "--kv-block-size", type=int, default=16, help="positions per KV block (default 16)"
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (default on a GPU: decode steps replay CUDA graphs "
        "captured at start-up)",
    )
    serve.add_argument("--batch-wait-timeout", type=float, default=0.05, help="static mode")
    add_model_name_args(serve)
    serve.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="the format the model writes tool calls in (default auto: by the chat template; "
        "Qwen/Hermes and ChatML: hermes, Llama 3: llama3_json, Gemma: pythonic)",
    )
    add_request_limit_args(serve)
    add_embedding_args(serve)
    add_connection_args(serve)
    add_transport_args(serve)
    add_observability_args(serve)
    add_access_args(serve)
    tinker = serve.add_argument_group("Tinker fine-tuning API (/api/v1)")
    tinker.add_argument(
        "--no-tinker", dest="tinker", action="store_false", help="do not serve the Tinker API"
    )
    tinker.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where LoRA checkpoints and runs are kept (default ~/.cache/infer/tinker)",
    )
    tinker.add_argument(
        "--tinker-api-key",
        action="append",
        default=None,
        help="an accepted API key (repeatable; also INFER_TINKER_API_KEYS, comma-separated); "
        "none given: any key starting with 'tml-' (each key owns what it makes)",
    )
    tinker.add_argument(
        "--tinker-alias",
        action="append",
        default=None,
        help="another name to advertise the model under (repeatable; the embedded SmolLM2 "
        "defaults to Qwen/Qwen3-4B-Instruct-2507, whose tinker-cookbook renderer is ChatML)",
    )
    add_tinker_limit_args(tinker)
    serve.set_defaults(func=_serve)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file, hub id, 'dummy:<name>', or alias "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        type=lambda name: DTYPE_ALIASES.get(name, name),
        choices=["auto", *sorted(DTYPES)],
        help="also vLLM's names: half, float, bf16; auto (default): bfloat16 on a GPU, on a "
        "CPU the faster of bfloat16 and float32 for the model's shapes, measured once",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_CHOICES,
        help="weight-only quantization of the linears: int8 (per channel), int4 (groups of "
        "32), gguf (a .gguf model's own quantized blocks, no dequantizing), auto (gguf for "
        "a GGUF model on a CPU, else none); default: auto for infer serve, none (the weights "
        "in --dtype) for infer generate",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    _add_threads_arg(p)
    p.add_argument(
        "--cache-dir", default=None, help="converted-weights cache (default ~/.cache/infer)"
    )


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="intra-op CPU threads for the model and the kernels (default: every CPU this "
        "process may use)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _build_kernels(args: argparse.Namespace) -> int:
    """Build (or find built) each kernel family, then measure (or find measured) the kernel
    paths ``--dtype auto`` chooses from for the model (the embedded one by default), so
    that its first start reads them; 0 when the portable kernels, which any CPU with a
    compiler runs, are ready."""
    from adapters.torch.cpu.build import kernel_cache_dir
    from adapters.torch.cpu.kernels import cpu_has_kernel_isa, cpu_kernels
    from adapters.torch.cpu.portable import portable_kernels
    from adapters.torch.cpu.tuning import linear_shapes, tuned, tuning_path
    from adapters.torch.models.config import ModelConfig
    from domain.errors import ModelLoadError
    from entrypoints.container import default_device

    configure_logging("info", "console")
    set_threads(args.threads)  # the tuning is per thread count: serve's default
    portable = _ready(portable_kernels() is not None)
    avx512 = _ready(cpu_kernels() is not None) if cpu_has_kernel_isa() else "not for this CPU"
    print(f"portable kernels (paged attention, quantized linears): {portable}")
    print(f"AVX512-BF16 kernels (bf16 linears, fused decode): {avx512}")
    print(f"cache: {kernel_cache_dir()}")
    if default_device() == "cpu":
        try:
            resolved = create_container(args.model, cache_dir=args.cache_dir).resolved_model()
        except ModelLoadError as e:  # e.g. the default model's wheel is not installed
            print(f"--dtype auto: not measured ahead ({e})")
            return 0 if portable == "ready" else 1
        shapes = linear_shapes(ModelConfig.from_folder(resolved.path))
        tuning = tuned(shapes)
        print(f"--dtype auto for {resolved.name}: {tuning.dtype} ({tuning.reason})")
        print(f"kernel paths measured: {tuning_path(shapes)}")
    return 0 if portable == "ready" else 1


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from adapters.torch.cpu.tuning import isa_flags, linear_shapes, tuned
    from adapters.torch.models.config import ModelConfig

    configure_logging("info", "console")
    set_threads(args.threads)
    container = create_container(args.model, cache_dir=args.cache_dir)
    resolved = container.resolved_model()
    tuning = tuned(linear_shapes(ModelConfig.from_folder(resolved.path)), force=args.force)
    print(
        f"CPU: {tuning.cpu}; ISA: {' '.join(isa_flags()) or 'baseline'}; "
        f"{torch.get_num_threads()} threads; torch {torch.__version__}"
    )
    print(f"model {resolved.name}: linear shapes (out, in) {tuning.shapes}")
    rows = sorted({int(r) for timings in tuning.timings.values() for r in timings})
    print("\n| path | " + " | ".join(f"{r} rows (ms)" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for path, timings in tuning.timings.items():
        cells = [f"{timings[str(r)]:.2f}" if str(r) in timings else "" for r in rows]
        print(f"| {path} | " + " | ".join(cells) + " |")
    print(f"\n--dtype auto: {tuning.dtype} ({tuning.reason})")
    if tuning.dense_from_rows is None:
        print("quantized kernel: not built here (the PyTorch path dequantizes per call)")
    for key, switch in (tuning.dense_from_rows or {}).items():
        weights, dtype = key.split()
        print(
            f"quantized kernel, {weights} weights, {dtype} activations: integer dot products "
            f"below {switch} rows, dequantized tiles + GEMM from there"
        )
    return 0


def _ready(ok: bool) -> str:
    return "ready" if ok else "unavailable (PyTorch ops are used instead)"


def _generate(args: argparse.Namespace) -> int:
    """The generated text (and a final newline) on stdout, as it comes; logs and the timing
    line on stderr."""
    configure_logging(args.log_level)
    params = _sampling_params(args)
    set_threads(args.threads)
    container = create_container(
        args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        quantization=args.quantization,
    )
    start = time.perf_counter()
    limit = container.model().config.max_position_embeddings
    tokenizer = container.tokenizer()
    loaded = time.perf_counter()
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt_ids = tokenizer.render_chat([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt)
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidParameterError(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length {limit}",
        )
    # One request: KV blocks for as long as it can get, no waiting queue.
    config = EngineConfig(
        max_seq_len=max(1, len(prompt_ids) + params.max_tokens),
        max_batch_size=1,
        max_waiting_requests=1,
    )
    container.engine_config.override(providers.Object(config))
    engine = container.async_engine()
    first, count, reason = asyncio.run(_stream_to_stdout(engine, prompt_ids, params))
    end = time.perf_counter()
    print(flush=True)
    if not args.quiet and first is not None:
        decode = (count - 1) / (end - first) if count > 1 else 0.0
        print(
            f"[{container.resolved_model().name}] load {loaded - start:.2f} s, "
            f"prompt {len(prompt_ids)} tokens, TTFT {(first - loaded) * 1e3:.0f} ms, "
            f"{count} tokens at {decode:.1f} tok/s, finish: {reason}",
            file=sys.stderr,
        )
    return 0


async def _stream_to_stdout(
    engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams
) -> tuple[float | None, int, str | None]:
    """Run one request through the engine loop, its text written to stdout as it comes;
    (time of the first token, tokens, finish reason)."""
    engine.start()
    try:
        first, count, reason = None, 0, None
        async for output in await engine.stream(new_request_id("cli"), prompt_ids, params):
            if output.error is not None:
                raise RuntimeError(output.error)
            if output.token_id is not None:
                first = first or time.perf_counter()
                count += 1
            reason = output.finish_reason or reason
            sys.stdout.write(output.text_delta)
            sys.stdout.flush()
        return first, count, reason
    finally:
        await engine.stop()


def _serve(args: argparse.Namespace) -> int:
    limits = connection_limits(args)  # checked before the model loads
    transport = transport_settings(args)
    observability = observability_settings(args)
    keyring, keys_source = keyring_from_args(args)
    models = model_settings(args)
    configure_logging(args.log_level, args.log_format)
    set_threads(args.threads)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidParameterError(
                "model", f"given twice: {args.model_tag!r} and --model {args.model!r}"
            )
        args.model = args.model_tag
    if args.max_batch_size is None:  # vLLM's default on a GPU; what a CPU serves well
        from entrypoints.container import default_device

        device = args.device or default_device()
        args.max_batch_size = MAX_NUM_SEQS["cuda" if device.startswith("cuda") else "cpu"]
    if args.kv_cache_memory is None and args.num_kv_blocks is None:
        args.kv_cache_memory = AUTO

    config = EngineConfig(
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        max_waiting_requests=args.max_waiting_requests,
        batching_mode=args.batching_mode,
        batch_wait_timeout_s=args.batch_wait_timeout,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching,
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
        **request_limits(args),
    )
    container = create_container(
        args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        quantization=args.quantization,
        engine=config,
        served_model_name=served_model_name(args),
        models=models,
        tinker=args.tinker,
        tinker_aliases=args.tinker_alias,
        tinker_api_keys=_api_keys(args.tinker_api_key),
        checkpoint_dir=args.checkpoint_dir,
        tinker_limits=tinker_limits(args, config.max_batch_size),
        observability=observability,
        keyring=keyring,
        redis_url=args.redis_url,
        idempotency_ttl_s=args.idempotency_ttl,
        idempotency_max_keys=args.idempotency_max_keys,
        on_startup=[lambda: sighup_reloader(container.access(), args.api_keys_file)()],
        transport=transport,
        embedding_model=embedding_model(args),
        embedding_limits=embedding_limits(args, config.max_prompt_bytes),
        tool_call_parser=args.tool_call_parser,
        kv_cache_memory=args.kv_cache_memory,
    )
    limit = container.model().config.max_position_embeddings
    if config.max_seq_len > limit:
        raise InvalidParameterError("max_seq_len", f"the model's context length is {limit}")
    embeddings = container.embeddings()  # its weights loaded before the KV pool is sized
    app = container.http_app()
    url = f"{'https' if transport.tls else 'http'}://{args.host}:{args.port}"
    _note(f"serving {container.resolved_model().name} at {url}")
    served = [e.id for e in container.served_models().entries()]
    _note(f"models: {', '.join(served)}")
    if embeddings is not None:
        _note(f"embeddings: {embeddings.model_name} at {url}/v1/embeddings")
    if args.tinker:
        names = ", ".join(container.served_names())
        _note(f"Tinker API: TINKER_BASE_URL={url} (models: {names})")
    if keyring is None:
        _note("API keys: none (an open server: anyone who reaches the port may call)")
    else:
        _note(f"API keys: {len(keyring.tenants)} tenants from {keys_source}")
    if observability.tracing.enabled:
        endpoint = observability.tracing.resolved_endpoint() or "the console"
        _note(f"traces: to {endpoint}")
    run_server(
        app,
        args.host,
        args.port,
        limits,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        draining=container.draining(),
        drain_timeout_s=transport.drain_timeout,
        **transport.uvicorn_tls(),
    )
    return 0


def _note(text: str) -> None:
    """A start-up line for the operator: on stderr, with the logs (stdout is for results)."""
    print(text, file=sys.stderr, flush=True)


def _kv_cache_memory(text: str) -> KVCacheMemory | str:
    """``--kv-cache-memory``'s value; argparse names the flag in its error."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_kv_cache_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _key(args: argparse.Namespace) -> int:
    key = args.existing or new_key()
    if args.existing is None:
        print(f"key: {key}")
    print(f'keys = ["{hash_key(key)}"]')
    return 0


def _api_keys(flags: list[str] | None) -> frozenset[str] | None:
    keys = [*(flags or []), *os.environ.get("INFER_TINKER_API_KEYS", "").split(",")]
    keys = [k.strip() for k in keys if k.strip()]
    return frozenset(keys) if keys else None


if __name__ == "__main__":
    sys.exit(main())
