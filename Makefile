# Two commands: `make demo` and `make test`. Everything else is set-up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pip arguments for the torch install (an index of CPU wheels, say).
TORCH_PIP_ARGS ?=

export HYPOTHESIS_PROFILE ?= ci

.PHONY: demo test lint setup gpu-check gpu-speed

setup: $(STAMP)

# Re-runs only when pyproject.toml changes. torch is installed first (and only if missing);
# then the torchvision built for that torch, and the extras, each with that torch pinned on the
# command line, so pip never replaces it (tools/torch_pins.py; docs/models.md), and a check
# that it did not.
$(STAMP): pyproject.toml tools/torch_pins.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/pip install $(TORCH_PIP_ARGS) torch==2.13.0
	TORCH=$$($(BIN)/python tools/torch_pins.py torch) && \
		VISION=$$($(BIN)/python tools/torch_pins.py torchvision) && \
		$(BIN)/pip install $(TORCH_PIP_ARGS) "$$TORCH" "$$VISION" && \
		$(BIN)/pip install -e '.[test,models]' "$$TORCH" "$$VISION" && \
		$(BIN)/python tools/torch_pins.py check "$$TORCH"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/funcpipe demo

# The exhaustive sweeps (@pytest.mark.slow) are left out; the 15 slowest tests are printed, and
# the end of the report shows what the rank pools held while idle (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --durations=15
	$(MAKE) lint

lint: $(STAMP)
	$(BIN)/ruff check funcpipe tests tools
	$(BIN)/ruff format --check funcpipe tests examples tools
	$(BIN)/mypy funcpipe tools

# On a machine with CUDA: the CUDA tests and the demo on a GPU, one report (gpu-check.md); without
# CUDA it says so and exits 0. It needs no venv and no network (GPU machines come with torch):
# the venv's python when there is one, else python3 with the repository on PYTHONPATH. docs/gpu.md.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_ARGS ?=

gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# On a machine with CUDA, after gpu-check: issue 41's speed proof (benchmarks/gpu_profile.py eager
# and compiled, the demo on one GPU, the planner's prediction), under $(OUT) or ./gpu-speed.
gpu-speed:
	GPU_PYTHON=$(GPU_PYTHON) bash tools/gpu_speed.sh
