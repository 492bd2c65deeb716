"""``infer`` command line: ``infer serve``, ``infer generate "prompt"``, ``infer key``, the
kernel commands. Standard output carries a command's result only (the generated text, a
key, a report); every log line, progress and timing goes to standard error. ``--help`` is
plain text (:class:`_PlainHelp` strips the reST markup of the help strings)."""

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from dependency_injector import providers

from adapters.observability.logging import LEVELS, configure_logging
from adapters.torch.cpu.threads import set_threads
from application.access.keys import hash_key, new_key
from application.engine.async_engine import AsyncEngine
from application.engine.request_ids import new_request_id
from domain.config import EngineConfig
from domain.errors import InferError, InvalidParameterError
from domain.memory import PANELS_AUTO_MAX, PANELS_AUTO_SHARE, human_size, parse_kv_cache_memory
from domain.sampling import SamplingParams
from entrypoints.config import ServerConfig
from entrypoints.config.access import add_access_args, sighup_reloader
from entrypoints.config.connection import add_connection_args
from entrypoints.config.embedding import add_embedding_args
from entrypoints.config.engine import add_engine_args, speculation, speculative_config
from entrypoints.config.generation import add_generation_args
from entrypoints.config.model import (
    DTYPE_NAMES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    add_model_name_args,
)
from entrypoints.config.observability import add_observability_args
from entrypoints.config.replica import add_replica_args
from entrypoints.config.request import add_request_limit_args
from entrypoints.config.tinker import add_tinker_limit_args
from entrypoints.config.transport import add_address_args, add_transport_args
from entrypoints.container import create_container
from entrypoints.kernel_commands import bench_kernels, build_kernels
from entrypoints.server import serve_configured

QUANTIZATION_CHOICES = [q for q in QUANTIZATIONS if q is not None]
# vLLM's dtype names (`auto` is decided per machine: adapters.torch.factory.choose_dtype).
DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "float": "float32"}


DESCRIPTION = (
    "infer: an LLM inference server with its own PyTorch engine. 'infer serve' serves the "
    "OpenAI-compatible API, /v1/generate and the Tinker fine-tuning API; 'infer generate' "
    "writes one prompt's text to stdout."
)


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
    for add in (_add_generate, _add_build_kernels, _add_bench_kernels, _add_key, _add_serve):
        add(sub)
    return parser


def _add_generate(sub: Any) -> None:
    """`infer generate`."""
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    _add_model_args(gen)
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user chat turn")
    _add_sampling_args(gen)
    gen.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help="as infer serve's (none: off); default: prompt lookup on a CPU, off on a GPU",
    )
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


def _add_build_kernels(sub: Any) -> None:
    """`infer build-kernels`."""
    kernels = sub.add_parser(
        "build-kernels",
        help="compile the CPU kernels this machine can run and measure what --dtype auto "
        "needs for the model, once (make setup does; otherwise the first model load does)",
    )
    kernels.add_argument("--model", default=None, help="model spec (default: the embedded one)")
    kernels.add_argument("--cache-dir", default=None, help="converted-weights cache")
    kernels.add_argument(
        "--retune",
        action="store_true",
        help="measure the kernel paths again even where a measurement is cached (after one "
        "made while the machine was busy: a start warns of it)",
    )
    _add_threads_arg(kernels)
    kernels.set_defaults(func=build_kernels)


def _add_bench_kernels(sub: Any) -> None:
    """`infer bench-kernels`."""
    bench = sub.add_parser(
        "bench-kernels",
        help="time this CPU's kernel paths on a model's linear shapes and print what "
        "--dtype auto and the quantized kernel choose, and why",
    )
    bench.add_argument("--model", default=None, help="model spec (default: the embedded one)")
    bench.add_argument("--cache-dir", default=None, help="converted-weights cache")
    bench.add_argument(
        "--force", "--retune", action="store_true", help="measure again, ignoring the cache"
    )
    _add_threads_arg(bench)
    bench.set_defaults(func=bench_kernels)


def _add_key(sub: Any) -> None:
    """`infer key`."""
    key = sub.add_parser("key", help="print a new API key and its line for --api-keys-file")
    key.add_argument("existing", nargs="?", help="hash this key instead of making one")
    key.set_defaults(func=_key)


def _add_serve(sub: Any) -> None:
    """`infer serve`: every group of its flags."""
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
    add_address_args(serve)
    add_engine_args(serve)
    add_model_name_args(serve)
    serve.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="the format the model writes tool calls in (default auto: by the chat template; "
        "Qwen/Hermes and ChatML: hermes, Llama 3: llama3_json, Gemma: pythonic)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="how a thinking model's thinking is told from its answer (reasoning_content, "
        "reasoning items, thinking blocks); default auto: the <think> parser when the chat "
        "template writes <think> (Qwen3, DeepSeek-R1), none otherwise; none: keep the "
        "thinking in the content",
    )
    add_request_limit_args(serve)
    add_generation_args(serve)
    add_embedding_args(serve)
    add_connection_args(serve)
    add_transport_args(serve)
    add_observability_args(serve)
    add_access_args(serve)
    add_replica_args(serve)
    _add_tinker_args(serve)
    serve.set_defaults(func=_serve)


def _add_tinker_args(serve: argparse.ArgumentParser) -> None:
    """`infer serve`'s Tinker flags."""
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
        help="another name to advertise the model under to Tinker clients (repeatable; none "
        "by default: clients would believe the server hosts that model)",
    )
    add_tinker_limit_args(tinker)


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
        choices=["auto", *sorted(DTYPE_NAMES)],
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
        "--dense-weights-memory",
        type=dense_weights_memory,
        default=None,
        metavar="SIZE|auto",
        help="a quantized model on a CPU keeps bf16 copies of its weights (the AVX512-BF16 "
        "kernels' panels) for steps of many rows, where this CPU's measurement found them "
        "faster than the quantized kernel, if they fit in this size (512MiB, 2GiB; 0: none); "
        f"default auto: {PANELS_AUTO_SHARE:g} of the memory available, at most "
        f"{human_size(PANELS_AUTO_MAX)}",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    _add_threads_arg(p)
    p.add_argument(
        "--cache-dir", default=None, help="converted-weights cache (default ~/.cache/infer)"
    )


def dense_weights_memory(text: str) -> int | None:
    """``--dense-weights-memory``'s bytes (None: auto); argparse names the flag in errors."""
    if text.strip().lower() == "auto":
        return None
    if text.strip() == "0":
        return 0
    try:
        size = parse_kv_cache_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size.nbytes is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size (512MiB, 2GiB, bytes), not a fraction")
    return size.nbytes


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


def _generate(args: argparse.Namespace) -> int:
    """The generated text (and a final newline) on stdout, as it comes; logs and the timing
    line on stderr."""
    from adapters.torch.factory import default_device

    configure_logging(args.log_level)
    params = _sampling_params(args)
    set_threads(args.threads)
    container = create_container(
        ServerConfig.for_model(
            args.model,
            dtype=args.dtype,
            device=args.device,
            cache_dir=args.cache_dir,
            quantization=args.quantization,
            dense_weights_memory=args.dense_weights_memory,
        )
    )
    start = time.perf_counter()
    limit = container.backend.model().config.max_position_embeddings
    tokenizer = container.backend.tokenizer()
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
        max_model_len=max(1, len(prompt_ids) + params.max_tokens),
        max_num_seqs=1,
        max_waiting_requests=1,
        speculative_config=speculation(args.speculative_config, args.device or default_device()),
    )
    container.backend().engine_config.override(providers.Object(config))  # the runner's too
    engine = container.async_engine()
    first, count, reason = asyncio.run(_stream_to_stdout(engine, prompt_ids, params))
    end = time.perf_counter()
    print(flush=True)
    if not args.quiet and first is not None:
        decode = (count - 1) / (end - first) if count > 1 else 0.0
        print(
            f"[{container.backend.resolved_model().name}] load {loaded - start:.2f} s, "
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
    from adapters.torch.factory import default_device

    # every flag checked before the model loads
    config = ServerConfig.from_args(args, device=default_device())
    configure_logging(config.observability.log_level, config.observability.log_format)
    if config.fleet.replicas:
        from entrypoints.replicas import serve_replicas  # Ray only when asked for

        return serve_replicas(config)
    set_threads(config.model.threads)
    keys_file = config.access.api_keys_file
    container = create_container(
        config, on_startup=[lambda: sighup_reloader(container.access(), keys_file)()]
    )
    limit = container.backend.model().config.max_position_embeddings
    if config.engine.max_model_len > limit:
        raise InvalidParameterError("max_model_len", f"the model's context length is {limit}")
    embeddings = container.backend.embeddings()  # its weights loaded before the KV pool is sized
    app = container.http_app()
    http = config.http
    url = f"{'https' if http.tls else 'http'}://{http.host}:{http.port}"
    _note(f"serving {container.backend.resolved_model().name} at {url}")
    served = [e.id for e in container.served_models().entries()]
    _note(f"models: {', '.join(served)}")
    if embeddings is not None:
        _note(f"embeddings: {embeddings.model_name} at {url}/v1/embeddings")
    if config.tinker.enabled:
        names = ", ".join(container.backend.served_names())
        _note(f"Tinker API: TINKER_BASE_URL={url} (models: {names})")
    keyring = container.keyring()
    if keyring is None:
        _note("API keys: none (an open server: anyone who reaches the port may call)")
    else:
        _note(f"API keys: {len(keyring.tenants)} tenants from {config.access.keys_source}")
    ledger = getattr(container.usage().ledger, "name", "this process's memory")
    _note(f"usage: recorded in {ledger} (GET /v1/organization/usage/completions)")
    tracing = config.observability.tracing
    if tracing.enabled:
        endpoint = tracing.resolved_endpoint() or "the console"
        _note(f"traces: to {endpoint}")
    serve_configured(app, config, container.draining())
    return 0


def _note(text: str) -> None:
    """A start-up line for the operator: on stderr, with the logs (stdout is for results)."""
    print(text, file=sys.stderr, flush=True)


def _key(args: argparse.Namespace) -> int:
    key = args.existing or new_key()
    if args.existing is None:
        print(f"key: {key}")
    print(f'keys = ["{hash_key(key)}"]')
    return 0


if __name__ == "__main__":
    sys.exit(main())
