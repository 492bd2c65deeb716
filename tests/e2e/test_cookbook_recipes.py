"""tinker-cookbook 0.6.1's recipes, unmodified, against a real `infer serve` on the default
model: RL (``rl_loop`` with its default stable_reinforce loss, ``math_rl`` on arithmetic),
DPO, on-policy distillation, and the supervised loop stopped and resumed. Each runs a few
steps in a subprocess (``tests/support/cookbook.py``) on tiny data the test ships in the
shape of the hub dataset the recipe loads (``tests/e2e/data/``), the hub off; see
docs/tinker.md's "Running the cookbook against infer"."""

import math
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from adapters.weights.factory import resolve
from tests.e2e.server import INFER, free_port
from tests.support.cookbook import (
    ROOT,
    checkpoints,
    cookbook_env,
    metrics,
    missing_cookbook,
    recipe_command,
    run_recipe,
)

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# rl_loop and sl_loop take their renderer from the model name only, and the cookbook knows
# no SmolLM2: they name the model by an alias whose renderer (qwen3_instruct) writes ChatML.
ALIAS = "Qwen/Qwen3-4B-Instruct-2507"
RENDERER = "qwen3_instruct"
DATA = Path(__file__).parent / "data"
DPO_BUILDER = "tinker_cookbook.preference.dpo_datasets:DPODatasetBuilderFromComparisons"
HH_COMPARISONS = "tinker_cookbook.recipes.preference.datasets:HHHComparisonBuilder"


class Server(NamedTuple):
    url: str
    log: Path  # its output: a failing recipe's message quotes its error lines


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`infer serve` with the alias, its output in a file (a pipe no one reads fills up)."""
    if (why := missing_cookbook()) is not None:
        pytest.fail(why)
    root = tmp_path_factory.mktemp("server")
    port = free_port()
    device = os.environ.get("INFER_TEST_DEVICE")  # as tests/e2e/server.py's
    command = [str(INFER), "serve", "--port", str(port), "--checkpoint-dir", str(root / "ckpt")]
    command += ["--tinker-alias", ALIAS, *(["--device", device] if device else [])]
    url = f"http://127.0.0.1:{port}"
    with (root / "server.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, (root / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "infer serve did not answer in 120 s"
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            yield Server(url, root / "server.log")
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def served_folder() -> Path:
    """The default model's folder, whose tokenizer the recipes are given."""
    return Path(resolve(None, None).path)


def test_rl_loop_trains_with_stable_reinforce(
    server: Server, served_folder: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "rl_loop"
    out = run_recipe(
        "tinker_cookbook.recipes.rl_loop",
        dict(
            base_url=server.url,
            model_name=ALIAS,
            batch_size=8,
            group_size=8,
            max_tokens=24,
            max_steps=2,
            lora_rank=8,
            log_path=log_path,
        ),
        tokenizers={ALIAS: served_folder},
        datasets={"openai/gsm8k": DATA / "gsm8k.json"},
        server_log=server.log,
    )
    assert "Training completed" in out
    rows = metrics(log_path)
    assert [row["progress/batch"] for row in rows] == [0, 1]
    # A batch whose groups all have equal rewards is skipped; ~9% of samples box the
    # right answer, so that both are skipped is a ~1e-5 chance.
    assert out.count("all advantages zero, skipping training step") < 2, out[-3000:]
    assert any(row["reward/total"] > 0 for row in rows)
    final = checkpoints(log_path)[-1]
    assert final["name"] == "final"
    assert final["state_path"].startswith("tinker://")
    assert final["sampler_path"].startswith("tinker://")


def test_math_rl_arithmetic(server: Server, served_folder: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "math_rl"
    out = run_recipe(
        "tinker_cookbook.recipes.math_rl.train",
        dict(
            base_url=server.url,
            model_name=MODEL,
            renderer_name=RENDERER,
            env="arithmetic",
            groups_per_batch=8,
            group_size=4,
            max_steps=2,
            lora_rank=8,
            eval_every=0,
            save_every=0,
            log_path=log_path,
        ),
        tokenizers={MODEL: served_folder},
        server_log=server.log,
    )
    assert "Training completed successfully" in out
    trained = [row for row in metrics(log_path) if "optim/kl_sample_train_v1" in row]
    assert len(trained) == 2
    for row in trained:
        assert math.isfinite(row["grad_norm:mean"]) and row["grad_norm:mean"] > 0
        # The sampler's logprobs of the sampled tokens are the trainer's: the same weights.
        assert abs(row["optim/kl_sample_train_v1"]) < 0.05, row
        assert "env/all/reward/total" in row


def test_dpo_learns_the_preferred_answers(
    server: Server, served_folder: Path, tmp_path: Path
) -> None:
    # recipes/preference/dpo/train.py evaluates a fixed 1,024 test pairs (2,048
    # compute_logprobs calls at the first and the last step): too slow for 2 CPU cores. Its
    # training loop runs here with the same dataset builder and a 4-pair test split.
    log_path = tmp_path / "dpo"
    out = run_recipe(
        "tinker_cookbook.preference.train_dpo:main",
        {
            "base_url": server.url,
            "model_name": MODEL,
            "renderer_name": RENDERER,
            "recipe_name": "infer_dpo",
            "log_path": log_path,
            "learning_rate": 1e-3,
            "lr_schedule": "constant",
            "lora_rank": 8,
            "num_epochs": 4,
            "dataset_builder": DPO_BUILDER,
            "dataset_builder.common_config.model_name_for_tokenizer": MODEL,
            "dataset_builder.common_config.renderer_name": RENDERER,
            "dataset_builder.common_config.batch_size": 4,
            "dataset_builder.common_config.max_length": 512,
            "dataset_builder.comparison_builder": HH_COMPARISONS,
            "dataset_builder.comparison_builder.test_size": 4,
        },
        tokenizers={MODEL: served_folder},
        datasets={"Anthropic/hh-rlhf": DATA / "hh-rlhf.json"},
        server_log=server.log,
    )
    assert "DPO training completed successfully" in out
    rows = metrics(log_path)
    assert len(rows) == 8  # 8 pairs, 4 a batch, 4 epochs
    # The policy starts as the reference: the loss is log 2.
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=0.01)
    assert rows[-1]["dpo_loss"] < 0.3 < rows[0]["dpo_loss"], [r["dpo_loss"] for r in rows]
    assert rows[-1]["accuracy"] == 1.0
    assert math.isfinite(rows[0]["test/nll"]) and math.isfinite(rows[-1]["test/nll"])


def test_on_policy_distillation(server: Server, served_folder: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "distillation"
    out = run_recipe(
        "tinker_cookbook.recipes.distillation.on_policy_distillation",
        dict(
            base_url=server.url,
            model_name=MODEL,
            teacher_model=MODEL,
            renderer_name=RENDERER,
            dataset="deepmath",
            groups_per_batch=4,
            group_size=2,
            max_tokens=24,
            max_steps=2,
            lora_rank=8,
            eval_every=0,
            save_every=0,
            log_path=log_path,
        ),
        tokenizers={MODEL: served_folder},
        datasets={"zwhe99/DeepMath-103K": DATA / "deepmath.json"},
        server_log=server.log,
    )
    assert "Training completed successfully" in out
    rows = [row for row in metrics(log_path) if "teacher_kl" in row]
    assert len(rows) == 2
    # The student starts as its teacher (the same base model): the teacher's
    # compute_logprobs agree with the student's sampling logprobs.
    assert abs(rows[0]["teacher_kl"]) < 0.05, rows[0]


def test_sl_loop_resumes_from_its_checkpoint(
    server: Server, served_folder: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "sl_loop"
    overrides: dict[str, object] = dict(
        base_url=server.url,
        model_name=ALIAS,
        batch_size=4,  # 40 rows: 10 batches
        learning_rate=1e-3,
        lora_rank=8,
        save_every=2,
        log_path=log_path,
    )
    sl_loop = "tinker_cookbook.recipes.sl_loop"
    tokenizers = {ALIAS: served_folder}
    data = {"HuggingFaceH4/no_robots": DATA / "no_robots.json"}
    # The first run is killed once it has saved its state at batch 2 (as a preempted job).
    with (tmp_path / "first.log").open("w") as first_log:
        first = subprocess.Popen(
            recipe_command(sl_loop, overrides, tokenizers=tokenizers, datasets=data),
            cwd=ROOT,
            env=cookbook_env(),
            stdout=first_log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while not checkpoints(log_path) and first.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint in 120 s"
                time.sleep(0.1)
        finally:
            first.kill()
            first.wait()
    saved = checkpoints(log_path)
    assert [c["name"] for c in saved] == ["000002"], (tmp_path / "first.log").read_text()[-3000:]
    assert saved[0]["batch"] == 2
    first_rows = metrics(log_path)
    assert [row["step"] for row in first_rows[:2]] == [0, 1]

    out = run_recipe(
        sl_loop,
        {**overrides, "max_steps": 4},
        tokenizers=tokenizers,
        datasets=data,
        server_log=server.log,
    )
    assert "Resuming from batch 2" in out
    resumed = metrics(log_path)[len(first_rows) :]
    assert [row["step"] for row in resumed] == [2, 3]
    # Every row is the same chat: a fresh adapter would score it as at step 0.
    assert resumed[0]["train_mean_nll"] < 0.6 * first_rows[0]["train_mean_nll"], (
        first_rows,
        resumed,
    )
    final = checkpoints(log_path)[-1]
    assert final["name"] == "final" and final["batch"] == 10
