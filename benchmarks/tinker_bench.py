"""What the Tinker SDK benchmarks (``bench_tinker_sft.py``, ``bench_tinker_rl.py``) share:
their LoRA options, ``infer serve`` started for the run, the transformers + PEFT baseline
model and step, and the PEFT / ours report."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_serving import _free_port, _stop, _wait_healthy  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what ``infer serve`` serves by default


def add_lora_args(parser: argparse.ArgumentParser, lr: float) -> None:
    """``--rank``, ``--lr`` (default ``lr``), ``--peft-baseline`` and ``--result-json``."""
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--peft-baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--result-json", type=Path, default=None)


def run_with_server(
    args: argparse.Namespace,
    make_peft_step: Callable[[argparse.Namespace, Path], Any],
    run_sdk: Callable[[argparse.Namespace, str, Any], dict[str, Any]],
    *flags: str,
) -> dict[str, Any]:
    """``run_sdk(args, url, peft_step)`` against ``infer serve`` (its default model, a
    temporary checkpoint folder, ``flags``) started for it; ``peft_step``: the PEFT
    baseline's (``make_peft_step(args, model folder)``), None without one."""
    from adapters.weights.factory import resolve

    folder = resolve(None, None, progress=True).path
    peft_step = make_peft_step(args, folder) if args.peft_baseline else None
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        command = [
            str(Path(sys.executable).with_name("infer")),
            "serve",
            "--port",
            str(port),
            "--checkpoint-dir",
            str(Path(tmp) / "checkpoints"),
            *flags,
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url, 300, log)
            return run_sdk(args, url, peft_step)
        finally:
            _stop(proc)


def peft_model(folder: Path, rank: int, lr: float, device: Any = None) -> tuple[Any, Any]:
    """transformers + PEFT as ours trains: rank ``rank``, alpha 32, the same targets, bf16
    base weights (on ``device``, None: where they load), float32 LoRA weights, AdamW with
    our defaults; (model, optimizer)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    if device is not None:
        model = model.to(device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=32, target_modules=[*targets, "lm_head"])
    model = get_peft_model(model, config)
    for p in model.parameters():  # LoRA weights in float32, as ours
        if p.requires_grad:
            p.data = p.data.float()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-12,
        weight_decay=0.0,
    )
    return model, optimizer


def finish_peft_step(optimizer: Any, start: float, device: Any = None) -> float:
    """A PEFT step's end: AdamW's update, the gradients zeroed, a CUDA ``device`` waited
    for; its seconds since ``start``."""
    optimizer.step()
    optimizer.zero_grad()
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - start


def report_peft(
    args: argparse.Namespace, o: dict[str, Any], peft_key: str, ours_key: str, step: str
) -> None:
    """A run's end: the PEFT baseline's seconds per step (``o[peft_key]``) against ours
    (``o[ours_key]``) printed when it ran, their median ratio kept in ``o`` as
    ``peft_over_ours_median``; ``o`` written as JSON to ``--result-json`` when given."""
    if o[peft_key]:
        ratios = [p / q for p, q in zip(o[peft_key], o[ours_key], strict=True)]
        o["peft_over_ours_median"] = statistics.median(ratios)
        print(
            f"  transformers + PEFT, same batches, interleaved: median "
            f"{statistics.median(o[peft_key]):.2f} s/step; PEFT / ours per {step}: median "
            f"{o['peft_over_ours_median']:.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(o, indent=1))
