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
    assert "top_p" in capsys.readouterr().err


def test_an_unknown_model_spec_exits_with_an_error(tmp_path, capsys) -> None:
    assert main(["generate", "hi", "--model", "nonsense", "--cache-dir", str(tmp_path)]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_the_command_needs_a_subcommand() -> None:
    with pytest.raises(SystemExit):
        main([])
