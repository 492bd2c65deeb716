"""``infer build-kernels`` and ``infer bench-kernels``: the CPU kernels built and the kernel
paths measured ahead of a start, and the measurement printed with what it chooses. Standard
output carries the report; logs go to standard error."""

import argparse

from adapters.observability.logging import configure_logging
from adapters.torch.cpu.threads import set_threads
from entrypoints.config import ServerConfig
from entrypoints.container import create_container


def build_kernels(args: argparse.Namespace) -> int:
    """Build (or find built) each kernel family, then measure (or find measured; measure
    again: ``--retune``) the kernel paths ``--dtype auto`` chooses from for the model (the
    embedded one by default), so that its first start reads them; 0 when the portable
    kernels, which any CPU with a compiler runs, are ready."""
    from adapters.torch.cpu.build import kernel_cache_dir
    from adapters.torch.cpu.kernels import cpu_has_kernel_isa, cpu_kernels
    from adapters.torch.cpu.portable import portable_kernels
    from adapters.torch.cpu.tuning import linear_shapes, tuned, tuning_path
    from adapters.torch.factory import default_device
    from adapters.torch.models.config import ModelConfig
    from domain.errors import ModelLoadError

    configure_logging("info", "console")
    set_threads(args.threads)  # the tuning is per thread count: serve's default
    portable = _ready(portable_kernels() is not None)
    avx512 = _ready(cpu_kernels() is not None) if cpu_has_kernel_isa() else "not for this CPU"
    print(f"portable kernels (paged attention, quantized linears): {portable}")
    print(f"AVX512-BF16 kernels (bf16 linears, fused decode): {avx512}")
    print(f"cache: {kernel_cache_dir()}")
    if default_device() == "cpu":
        try:
            config = ServerConfig.for_model(args.model, cache_dir=args.cache_dir)
            resolved = create_container(config).backend.resolved_model()
        except ModelLoadError as e:  # e.g. the default model's wheel is not installed
            print(f"--dtype auto: not measured ahead ({e})")
            return 0 if portable == "ready" else 1
        shapes = linear_shapes(ModelConfig.from_folder(resolved.path))
        tuning = tuned(shapes, force=args.retune)
        print(f"--dtype auto for {resolved.name}: {tuning.dtype} ({tuning.reason})")
        print(f"kernel paths measured: {tuning_path(shapes)}")
        if tuning.disturbed:
            print(
                f"  {len(tuning.disturbed)} comparisons stayed disturbed by other processes: "
                "`infer build-kernels --retune` on a quiet machine measures them again"
            )
        try:
            measure_steps(args)
        except Exception as e:  # the first start measures them instead: setup goes on
            print(f"step costs: not measured ahead ({type(e).__name__}: {e})")
    return 0 if portable == "ready" else 1


def measure_steps(args: argparse.Namespace) -> None:
    """What ``infer serve``'s steps cost with its defaults (speculation decides from them),
    measured on the loaded model (again with ``--retune``)."""
    from adapters.torch.runtime.step_costs import step_costs
    from entrypoints.config.engine import MAX_NUM_SEQS, SPECULATIVE_BY_DEVICE

    config = ServerConfig.for_model(  # infer serve's defaults on a CPU
        args.model,
        cache_dir=args.cache_dir,
        quantization="auto",
        kv_cache_memory="auto",
        max_num_seqs=MAX_NUM_SEQS["cpu"],
        speculative_config=SPECULATIVE_BY_DEVICE["cpu"],
    )
    backend = create_container(config).backend
    resolved = backend.resolved_model()
    key = f"{resolved.path}|{resolved.name}|{config.model.quantization}"
    costs = step_costs(backend.runner(), backend.engine_config(), key, force=args.retune)
    if costs is not None:
        k = SPECULATIVE_BY_DEVICE["cpu"]
        drafts = k.num_speculative_tokens if k is not None else 0
        print(
            f"step costs measured: 1 + {drafts} rows cost {costs.ratio(1, drafts):.2f}x one row "
            f"(steps of up to {max(costs.ms)} sequences)"
        )


def bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from adapters.torch.cpu.tuning import isa_flags, linear_shapes, tuned
    from adapters.torch.models.config import ModelConfig

    configure_logging("info", "console")
    set_threads(args.threads)
    container = create_container(ServerConfig.for_model(args.model, cache_dir=args.cache_dir))
    resolved = container.backend.resolved_model()
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
        chosen = (
            "not timed undisturbed, the kernel's default"
            if switch is None
            else f"integer dot products below {switch} rows, dequantized tiles + GEMM from there"
        )
        print(f"quantized kernel, {weights} weights, {dtype} activations: {chosen}")
    for key, switch in (tuning.panels_from_rows or {}).items():
        weights, dtype = key.split()
        panels = (
            "never faster than the quantized kernel (none kept)"
            if switch is None
            else f"steps of {switch} rows or more (within --dense-weights-memory)"
        )
        print(f"bf16 panel copies of {weights} weights: {panels}")
    if tuning.disturbed:
        print(
            f"{len(tuning.disturbed)} comparisons stayed disturbed by other processes (left "
            "out of the choices): `--retune` on a quiet machine measures them again"
        )
    return 0


def _ready(ok: bool) -> str:
    return "ready" if ok else "unavailable (PyTorch ops are used instead)"
