"""`infer generate` end to end in-process, on a random-weight real config (no download)."""

import pytest

from entrypoints.cli import main


def test_generate_streams_text_and_reports_timing(tmp_path, capsys) -> None:
    code = main(
        [
            "generate",
            "hello",
            "--model",
            "dummy:SmolLM2-135M",
            "--max-tokens",
            "5",
            "--cache-dir",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert out.endswith("\n")
    assert "[dummy:SmolLM2-135M]" in err and "5 tokens" in err and "finish: length" in err


def test_generate_speculates_by_default_on_a_cpu_and_not_when_told(tmp_path, capsys) -> None:
    # The same greedy text either way (a random model's output loops: it drafts from it).
    argv = ["generate", "a b a b a b", "--model", "dummy:SmolLM2-135M", "--max-tokens", "24"]
    argv += ["--temperature", "0", "--cache-dir", str(tmp_path), "--device", "cpu"]
    assert main(argv) == 0
    drafted, err = capsys.readouterr()
    assert "speculative decoding" in err
    assert main([*argv, "--speculative-config", "none"]) == 0
    plain, err = capsys.readouterr()
    assert "speculative decoding" not in err
    assert drafted == plain
    with pytest.raises(SystemExit):
        main([*argv, "--speculative-config", '{"method": "eagle"}'])
    assert "--speculative-config: speculative_config.method 'eagle'" in capsys.readouterr().err


def test_bad_sampling_flags_exit_with_a_named_error(tmp_path, capsys) -> None:
    argv = ["generate", "hi", "--model", "dummy:SmolLM2-135M", "--top-p", "0"]
    assert main([*argv, "--cache-dir", str(tmp_path)]) == 2
    assert "error: --top-p: must be in (0, 1]" in capsys.readouterr().err


def test_a_request_past_the_models_context_is_refused_by_its_flag(tmp_path, capsys) -> None:
    argv = ["generate", "hi", "--model", "dummy:SmolLM2-135M", "--max-tokens", "100000"]
    assert main([*argv, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: --max-tokens:" in err and "context length 8192" in err


def test_an_unknown_model_spec_exits_with_an_error(tmp_path, capsys) -> None:
    assert main(["generate", "hi", "--model", "nonsense", "--cache-dir", str(tmp_path)]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_the_command_needs_a_subcommand() -> None:
    with pytest.raises(SystemExit):
        main([])


def test_serve_takes_vllms_spellings(monkeypatch) -> None:
    """`infer serve MODEL --max-model-len N --max-num-seqs B --dtype half`, as vllm serve."""
    import uvicorn

    from entrypoints import cli

    seen: dict = {}

    def fake_create_container(config, **kwargs):
        seen.update(model=config.model.model, dtype=config.model.dtype, engine=config.engine)
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    argv = ["serve", "dummy:SmolLM2-135M", "--max-model-len", "512", "--max-num-seqs", "4"]
    assert main([*argv, "--dtype", "half"]) == 2
    assert (seen["model"], seen["dtype"]) == ("dummy:SmolLM2-135M", "float16")
    assert (seen["engine"].max_model_len, seen["engine"].max_num_seqs) == (512, 4)
    assert seen["engine"].prefix_caching  # on by default
    assert main([*argv, "--no-prefix-caching"]) == 2
    assert not seen["engine"].prefix_caching
    assert main(["serve", "--dtype", "auto"]) == 2 and seen["dtype"] == "auto"
    assert main(["serve"]) == 2 and seen["dtype"] == "auto"  # the default
    assert main(["serve", "--dtype", "bf16"]) == 2 and seen["dtype"] == "bfloat16"


def test_threads_sets_the_intra_op_threads_and_refuses_zero(monkeypatch, capsys) -> None:
    import torch

    from adapters.torch.cpu.threads import available_cpus
    from entrypoints import cli

    seen: dict = {}

    def fake_create_container(config, **kwargs):
        seen["threads"] = torch.get_num_threads()
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    before = torch.get_num_threads()
    try:
        assert main(["serve", "dummy:SmolLM2-135M", "--threads", "1"]) == 2
        assert seen.pop("threads") == 1
        assert main(["generate", "hi", "--model", "dummy:SmolLM2-135M"]) == 2
        assert seen.pop("threads") == available_cpus()  # the default: every usable CPU
        assert main(["serve", "--threads", "0"]) == 2
        assert "error: --threads: must be at least 1, got 0" in capsys.readouterr().err
        assert "threads" not in seen  # refused before anything loads
    finally:
        torch.set_num_threads(before)


def test_serve_refuses_two_different_models(capsys) -> None:
    assert main(["serve", "dummy:SmolLM2-135M", "--model", "dummy:Qwen3-0.6B"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_serve_takes_the_request_limits_as_flags(monkeypatch) -> None:
    from entrypoints import cli

    seen = {}

    def fake_create_container(config, **kwargs):
        seen["engine"] = config.engine.engine_config()
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    flags = {
        "--max-prompt-bytes": 1000,
        "--max-prompts-per-request": 3,
        "--max-stop-strings": 4,
        "--max-stop-bytes": 50,
        "--prepare-threads": 1,
    }
    argv = [str(a) for flag, value in flags.items() for a in (flag, value)]
    assert main(["serve", *argv, "--trust-chat-special-tokens"]) == 2
    engine = seen["engine"]
    assert (engine.max_prompt_bytes, engine.max_prompts_per_request) == (1000, 3)
    assert (engine.max_stop_strings, engine.max_stop_bytes) == (4, 50)
    assert engine.prepare_threads == 1 and engine.trust_chat_special_tokens


@pytest.mark.parametrize(
    "flag", ["--max-prompt-bytes", "--max-prompts-per-request", "--prepare-threads"]
)
def test_a_bad_request_limit_is_refused_by_its_flag_before_the_model_loads(
    flag, monkeypatch, capsys
) -> None:
    from entrypoints import cli

    monkeypatch.setattr(cli, "create_container", lambda *a, **k: pytest.fail("loaded"))
    assert main(["serve", flag, "0"]) == 2
    assert f"error: {flag}: must be >= 1" in capsys.readouterr().err


# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; a bfloat16 block of 16 positions (K and V).
SMOLLM2_BLOCK = 2 * 30 * 3 * 16 * 64 * 2


def _serve_without_listening(monkeypatch) -> list:
    """`infer serve` builds everything and returns instead of serving; the containers."""
    from entrypoints import cli

    built = []
    real = cli.create_container

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(cli, "create_container", spy)
    monkeypatch.setattr(cli, "serve_configured", lambda *a, **k: None)
    return built


def test_serve_sizes_the_kv_cache_by_memory(tmp_path, monkeypatch, capsys) -> None:
    """--kv-cache-memory decides the block count: the scheduler's blocks and the runner's
    pool agree, --max-num-seqs stays the running cap, and one log line says so."""
    import json

    built = _serve_without_listening(monkeypatch)
    argv = ["serve", "dummy:SmolLM2-135M", "--device", "cpu", "--cache-dir", str(tmp_path)]
    argv += ["--dtype", "bfloat16"]  # SMOLLM2_BLOCK is a bf16 block
    argv += ["--no-tinker", "--max-model-len", "512", "--max-num-seqs", "2"]
    assert main([*argv, "--kv-cache-memory", "64MiB", "--log-format", "json"]) == 0
    [container] = built
    blocks = (64 << 20) // SMOLLM2_BLOCK  # 182
    assert container.backend.runner().cache.num_blocks == blocks
    assert container.engine().scheduler.blocks.num_blocks == blocks
    assert container.engine().config.max_num_seqs == 2
    logs = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line[:1] == "{"]
    [line] = [entry for entry in logs if entry.get("event") == "KV cache"]
    assert (line["blocks"], line["block_size"], line["max_concurrency"]) == (blocks, 16, 5)
    assert line["memory_mib"] == round(blocks * SMOLLM2_BLOCK / (1 << 20), 1)
    assert line["tokens_per_request"] == 512


def test_serve_refuses_a_kv_budget_short_of_one_request(tmp_path, monkeypatch, capsys) -> None:
    _serve_without_listening(monkeypatch)
    argv = ["serve", "dummy:SmolLM2-135M", "--device", "cpu", "--cache-dir", str(tmp_path)]
    argv += ["--dtype", "bfloat16"]  # SMOLLM2_BLOCK is a bf16 block
    argv += ["--no-tinker", "--max-model-len", "512", "--kv-cache-memory", "1MiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --kv-cache-memory: 1.0 MiB hold 2 KV blocks" in err
    assert "needs 32 blocks: 11.2 MiB at least" in err


def test_serve_maps_the_kv_pool_flags(monkeypatch) -> None:
    from domain.memory import KVCacheMemory
    from entrypoints import cli
    from entrypoints.config.engine import MAX_NUM_SEQS

    seen: dict = {}

    def fake_create_container(config, **kwargs):
        seen.update(engine=config.engine, memory=config.model.kv_cache_memory)
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    assert main(["serve", "--device", "cpu"]) == 2  # the defaults: sized from memory
    assert (seen["memory"], seen["engine"].num_kv_blocks) == ("auto", None)
    assert seen["engine"].kv_block_size == 16
    assert seen["engine"].max_num_seqs == MAX_NUM_SEQS["cpu"] == 64
    assert main(["serve", "--device", "cuda", "--kv-cache-memory", "auto"]) == 2
    assert seen["memory"] == "auto" and seen["engine"].max_num_seqs == 256
    assert main(["serve", "--num-kv-blocks", "4096", "--max-num-seqs", "8"]) == 2
    assert (seen["memory"], seen["engine"].num_kv_blocks) == (None, 4096)
    assert seen["engine"].max_num_seqs == 8
    assert main(["serve", "--kv-cache-memory", "0.9", "--kv-block-size", "32"]) == 2
    assert seen["memory"] == KVCacheMemory(fraction=0.9) and seen["engine"].kv_block_size == 32
    assert main(["serve", "--num-kv-blocks", "1000", "--max-seq-len", "256"]) == 2
    assert seen["engine"].num_kv_blocks == 1000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: 'lots' is not a size"),
        (["--kv-cache-memory", "1.5"], "argument --kv-cache-memory: '1.5': a fraction"),
        (
            ["--kv-cache-memory", "1GiB", "--num-kv-blocks", "100"],
            "argument --num-kv-blocks: not allowed with argument --kv-cache-memory",
        ),
    ],
)
def test_bad_kv_pool_flags_are_argparse_errors(argv, message, monkeypatch, capsys) -> None:
    from entrypoints import cli

    monkeypatch.setattr(cli, "create_container", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_too_few_kv_blocks_are_refused_by_their_flag_saying_the_minimum(
    monkeypatch, capsys
) -> None:
    from entrypoints import cli

    monkeypatch.setattr(cli, "create_container", lambda *a, **k: pytest.fail("loaded"))
    assert main(["serve", "--num-kv-blocks", "10", "--max-seq-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "error: --num-kv-blocks: must hold one request" in err and "16 blocks" in err


def test_the_fake_runner_ignores_the_kv_budget() -> None:
    from domain.config import EngineConfig
    from domain.memory import KVCacheMemory
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    engine = EngineConfig(max_model_len=64, max_num_seqs=2)
    tiny = KVCacheMemory(nbytes=1)  # would not hold a request on the torch runner
    config = ServerConfig.for_model(runner="fake", engine=engine, kv_cache_memory=tiny)
    container = create_container(config)
    assert container.backend.engine_config() == engine
    assert container.engine().scheduler.blocks.num_blocks == engine.kv_blocks == 8


def test_generate_runs_a_quantized_model_and_logs_its_weights(tmp_path, capsys) -> None:
    argv = ["generate", "hello", "--model", "dummy:SmolLM2-135M", "--max-tokens", "3"]
    argv += ["--dtype", "float32", "--quantization", "int4"]
    assert main([*argv, "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "3 tokens" in err
    assert "quantized weights" in out + err and "int4" in out + err


def test_quantization_gguf_needs_a_gguf_model(tmp_path, capsys) -> None:
    argv = ["generate", "hi", "--model", "dummy:SmolLM2-135M", "--quantization", "gguf"]
    assert main([*argv, "--cache-dir", str(tmp_path)]) == 2
    assert "gguf quantization needs a GGUF model" in capsys.readouterr().err


def test_an_unknown_quantization_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--quantization", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err


def test_build_kernels_reports_what_this_cpu_runs(capsys) -> None:
    code = main(["build-kernels"])
    out = capsys.readouterr().out
    assert "portable kernels (paged attention, quantized linears):" in out
    assert "AVX512-BF16 kernels" in out and "cache:" in out
    assert code == (0 if "quantized linears): ready" in out else 1)
