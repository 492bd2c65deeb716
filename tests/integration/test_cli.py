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

    seen = {}

    def fake_create_container(model, **kwargs):
        seen.update(model=model, dtype=kwargs["dtype"], engine=kwargs["engine"])
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    argv = ["serve", "dummy:SmolLM2-135M", "--max-model-len", "512", "--max-num-seqs", "4"]
    assert main([*argv, "--dtype", "half"]) == 2
    assert (seen["model"], seen["dtype"]) == ("dummy:SmolLM2-135M", "float16")
    assert (seen["engine"].max_seq_len, seen["engine"].max_batch_size) == (512, 4)
    assert seen["engine"].enable_prefix_caching  # on by default
    assert main([*argv, "--no-prefix-caching"]) == 2
    assert not seen["engine"].enable_prefix_caching
    assert main(["serve", "--dtype", "auto"]) == 2 and seen["dtype"] == "bfloat16"


def test_serve_refuses_two_different_models(capsys) -> None:
    assert main(["serve", "dummy:SmolLM2-135M", "--model", "dummy:Qwen3-0.6B"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_serve_takes_the_request_limits_as_flags(monkeypatch) -> None:
    from entrypoints import cli

    seen = {}

    def fake_create_container(model, **kwargs):
        seen["engine"] = kwargs["engine"]
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
