"""Run a tinker-cookbook recipe, unmodified, against `infer serve`.

As a program (from the repository root, with the cookbook that `make setup` installs in
``.cookbook/``)::

    PYTHONPATH=.cookbook .venv/bin/python -m tests.support.cookbook \\
        [--tokenizer NAME[=DIR]]... [--dataset HF_NAME=FILE]... TARGET [key=value ...]

it registers the tokenizer in DIR (without ``=DIR``: the default model's folder, which
`infer serve` serves) under NAME, so the cookbook does not download one; makes
``datasets.load_dataset(HF_NAME, ...)`` return FILE's tiny dataset (a JSON object
``{split: [row, ...]}``; any other name still goes to the hub); then runs TARGET with the
chz overrides as its command line: a module as ``__main__`` (a recipe's CLI), or
``module:function`` through ``chz.nested_entrypoint`` (a training loop whose config the
recipe's CLI does not expose in full). Nothing else of the cookbook is touched.

Imported, it gives the tests ``run_recipe`` (the same in a subprocess, hub access off),
``metrics`` and ``checkpoints`` (what the recipe logged).
"""

import argparse
import asyncio
import importlib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = ROOT / ".cookbook"  # `make setup` installs tinker-cookbook 0.6.1 here
API_KEY = "tml-cookbook"


def missing_cookbook() -> str | None:
    """Why the cookbook cannot run (None: it can)."""
    if (COOKBOOK / "tinker_cookbook").is_dir():
        return None
    return f"tinker-cookbook is not installed in {COOKBOOK}: run `make setup`"


def cookbook_env() -> dict[str, str]:
    """A recipe's environment: the cookbook importable, the hub and telemetry off."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(COOKBOOK), str(ROOT)]),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TINKER_API_KEY=API_KEY,
        TINKER_TELEMETRY="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def recipe_command(
    target: str,
    overrides: Mapping[str, object],
    *,
    tokenizers: Mapping[str, Path],
    datasets: Mapping[str, Path] | None = None,
) -> list[str]:
    """This program's command line for ``target`` with ``key=value`` overrides."""
    command = [sys.executable, "-m", "tests.support.cookbook"]
    command += [f"--tokenizer={name}={folder}" for name, folder in tokenizers.items()]
    command += [f"--dataset={name}={file}" for name, file in (datasets or {}).items()]
    return [*command, target, *(f"{key}={value}" for key, value in overrides.items())]


def run_recipe(
    target: str,
    overrides: Mapping[str, object],
    *,
    tokenizers: Mapping[str, Path],
    datasets: Mapping[str, Path] | None = None,
    server_log: Path | None = None,
    timeout_s: float = 170,
) -> str:
    """Run ``target`` to its end; its output (stdout and stderr). A failure raises with
    the output's tail and the error lines of ``server_log`` (the server's output)."""
    done = subprocess.run(
        recipe_command(target, overrides, tokenizers=tokenizers, datasets=datasets),
        cwd=ROOT,
        env=cookbook_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        errors = server_errors(server_log) if server_log is not None else ""
        raise AssertionError(
            f"{target} exited with {done.returncode}:\n{done.stdout[-6000:]}\n{errors}"
        )
    return done.stdout


def server_errors(server_log: Path) -> str:
    """The error lines of the server's (JSON) log, for a failure's message."""
    lines = server_log.read_text(errors="replace").splitlines() if server_log.exists() else []
    errors = [line for line in lines if '"level": "error"' in line or "Traceback" in line]
    return "server errors:\n" + "\n".join(errors[-5:])


def _jsonl(file: Path) -> list[dict[str, Any]]:
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def metrics(log_path: Path) -> list[dict[str, Any]]:
    """The rows of the recipe's ``metrics.jsonl`` (one per logged step)."""
    return _jsonl(log_path / "metrics.jsonl")


def checkpoints(log_path: Path) -> list[dict[str, Any]]:
    """The records of the recipe's ``checkpoints.jsonl`` (name, loop state, paths)."""
    return _jsonl(log_path / "checkpoints.jsonl")


def _register_tokenizer(name: str, folder: str | None) -> None:
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    if folder is None:
        from adapters.weights.factory import resolve

        folder = str(resolve(None, None).path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer_utils.register_tokenizer(name, lambda: tokenizer)


def _local_datasets(files: Mapping[str, str]) -> None:
    """``datasets.load_dataset`` answers the named datasets from the local files."""
    import datasets

    hub_load = datasets.load_dataset

    def load_dataset(path: str, *args: Any, split: str | None = None, **kwargs: Any) -> Any:
        if path not in files:
            return hub_load(path, *args, split=split, **kwargs)
        splits = json.loads(Path(files[path]).read_text())
        local = datasets.DatasetDict(
            {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
        )
        return local if split is None else local[split]

    datasets.load_dataset = load_dataset


def _pairs(values: Sequence[str]) -> dict[str, str]:
    return dict(value.split("=", 1) for value in values)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokenizer", action="append", default=[], metavar="NAME[=DIR]")
    parser.add_argument("--dataset", action="append", default=[], metavar="HF_NAME=FILE")
    parser.add_argument("target", help="a module run as __main__, or module:function (chz)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="chz key=value")
    args = parser.parse_args(argv)
    for spec in args.tokenizer:
        name, _, folder = spec.partition("=")
        _register_tokenizer(name, folder or None)
    _local_datasets(_pairs(args.dataset))
    module, _, function = args.target.partition(":")
    sys.argv = [module, *args.overrides]
    if not function:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    import chz

    result = chz.nested_entrypoint(
        getattr(importlib.import_module(module), function), argv=args.overrides
    )
    if asyncio.iscoroutine(result):
        asyncio.run(result)


if __name__ == "__main__":
    main()
