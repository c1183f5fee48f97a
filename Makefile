# The two commands a new user types (see README):  make demo  /  make test
VENV ?= .venv
PYTHON ?= python3
# CPU torch: this exact version lies on disk on our dev/CI machines. Elsewhere, add
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu to get the CPU build, not CUDA.
TORCH_SPEC ?= torch==2.13.0
BIN = $(VENV)/bin
# make test's pytest workers (pytest-xdist): the machine's cores, at most 4 (tests start
# training processes of their own); TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
# DeepSpeed (dev extra, CPU tests) installs without compiling its CUDA ops.
export DS_BUILD_OPS = 0
# Python keeps the bytecode it compiles (__pycache__), as it does by default. Installs skip
# byte-compiling (pip --no-compile: most of a wheel's modules are never imported), so on a
# machine that sets PYTHONDONTWRITEBYTECODE=1 (ours, many container shells) every process would
# compile every module it imports from source again: torch + transformers + mlflow + kfp +
# deepspeed take 13.4 CPU s to import that way and 5.8 s from their caches (docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-runtime demo test test-megatron test-vllm rehearse rehearse-ci gpu-check-dry-run gpu-wheels lint format bench clean

# the demo needs only the runtime dependencies and CPU torch; the tests add the `dev` extra
setup-runtime: $(VENV)/.runtime-installed
setup: $(VENV)/.installed

$(VENV)/.runtime-installed: pyproject.toml
	@echo "setting up $(VENV): CPU torch and lingo-rl's runtime dependencies"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check --no-compile "$(TORCH_SPEC)"
	@$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -e .
	@touch $@

$(VENV)/.installed: $(VENV)/.runtime-installed
	@echo "adding the test extras (dev) to $(VENV)"
	@$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -e ".[dev]"
	@touch $@

demo: setup-runtime  ## run the whole pipeline locally (kfp.local, tiny model, bundled data)
	@$(BIN)/lingo run --local --output-dir runs/local

test: setup  ## lint, then the test suite (slow/gpu/cluster tests deselected by default)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-megatron:  ## the Megatron round trip HF -> Megatron -> HF on CPU, in a Python 3.12 env (tools/megatron_env.sh, ~5 GB)
	bash tools/run_megatron_tests.sh -q

test-vllm:  ## the vLLM engines on vLLM's CPU build (tests/vllm_engines), in their own env (tools/vllm_env.sh, ~2.5 GB)
	bash tools/run_vllm_tests.sh -q

rehearse: setup  ## lingo rehearse of the 20b presets on CPU, each step as its pod, each TrainJob's pods as processes (issue #39; slow)
	$(BIN)/python -m pytest -q -m slow tests/pipelines/test_rehearsal.py -k "not megatron"

rehearse-ci: setup  ## the rehearsal CI runs: gpt-oss-20b-verl on DeepSpeed (two-image job, dedicated engines)
	$(BIN)/python -m pytest -q -m slow tests/pipelines/test_rehearsal.py -k "verl"

gpu-check-dry-run: setup  ## bench/gpu_check.py on CPU with tiny shapes, as the GPU machine's Python would see it (~3 min)
	$(BIN)/python -m pytest -q -m slow tests/bench/test_gpu_check.py

gpu-wheels: setup  ## the wheels bench/gpu_check.py carries to the GPU machine (.whl/gpu; needs PyPI)
	$(BIN)/python tools/build_gpu_wheels.py

lint:
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format:
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python bench/data_prep.py

clean:
	rm -rf $(VENV) .venv-megatron .venv-vllm runs .pytest_cache .ruff_cache
