"""Issue 28 §1 and §6: the CLI's stdout carries its result only (every log line, progress
and timing on stderr), and every ``--help`` is plain text (no reStructuredText markup)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.torch.cpu.threads import available_cpus
from domain.sampling import SamplingParams
from entrypoints import cli

INFER = Path(sys.executable).with_name("infer")
PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("infer-cache")


def _infer(*argv: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(INFER), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def _log_lines(stderr: str) -> list[dict]:
    """stderr's structured log lines (JSON: stderr is not a terminal here)."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_generate_writes_only_the_text_to_stdout_and_logs_to_stderr(cache_dir) -> None:
    """Two greedy runs of the default model: stdout is exactly the generated text (and a
    final newline), the same both times; the log lines and the timing line are on stderr,
    info and above by default, debug too with -v."""
    import torch

    from entrypoints.inprocess import LLM

    argv = ["generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32"]
    argv += ["--cache-dir", str(cache_dir)]
    first = _infer(*argv)
    second = _infer(*argv, "-v")

    threads = torch.get_num_threads()
    try:  # the text, made in-process with the subprocesses' thread count
        llm = LLM(dtype="float32", cache_dir=str(cache_dir), threads=available_cpus())
        [result] = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    finally:
        torch.set_num_threads(threads)
    assert result.text.strip()
    assert first.stdout == result.text + "\n"
    assert second.stdout == first.stdout

    for run in (first, second):
        assert f"{MAX_TOKENS} tokens at" in run.stderr and "finish: length" in run.stderr
    default, verbose = _log_lines(first.stderr), _log_lines(second.stderr)
    assert all(line["level"] != "debug" for line in default)  # info and above by default
    assert any(line["event"] == "threads" and line["level"] == "debug" for line in verbose)
    assert "timestamp" in verbose[0]


def test_generate_log_level_warning_keeps_stderr_to_the_timing_line(cache_dir) -> None:
    argv = ["generate", PROMPT, "--max-tokens", "2", "--dtype", "float32", "-q"]
    done = _infer(*argv, "--cache-dir", str(cache_dir), "--log-level", "warning")
    assert done.stdout.strip()
    assert _log_lines(done.stderr) == [] and "tokens at" not in done.stderr


def test_key_prints_only_the_key_lines() -> None:
    made = _infer("key")
    key, line = made.stdout.splitlines()
    assert re.fullmatch(r"key: \S+", key) and made.stdout == f"{key}\n{line}\n"
    assert re.fullmatch(r'keys = \["\S+"\]', line)
    assert made.stderr == ""
    existing = key.removeprefix("key: ")
    again = [_infer("key", existing) for _ in range(2)]
    assert again[0].stdout == again[1].stdout == f"{line}\n"
    assert again[0].stderr == ""


def _commands() -> list[list[str]]:
    """The top-level parser and every subcommand, as argv before ``--help``."""
    parser = cli._parser()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [[], *([name] for name in subparsers.choices)]


ROLE = re.compile(r":(?:py:)?[a-z]+:`")


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "infer")
def test_help_is_plain_text(command, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "usage: infer" in out
    assert "``" not in out and "`" not in out and not ROLE.search(out)
    for role in (":class:", ":func:", ":meth:", ":mod:", ":attr:", ":ref:"):
        assert role not in out


def test_plain_text_drops_the_markup() -> None:
    text = "``infer`` runs :class:`AsyncEngine`, :func:`~a.b.run`, :ref:`docs <x>` and `n`"
    assert cli.plain_text(text) == "infer runs AsyncEngine, run, docs and 'n'"
