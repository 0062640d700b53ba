# Entry points: `make demo` runs the main job, `make test` the tests, `make fuzz` the long fuzz campaign.
# Each creates .venv on first use and installs what it needs.
# `make test-engines` runs the SGLang/vLLM loader tests against the real engines in .venv-engines.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# FlashBoot takes torch as a range, so it installs beside an engine's torch. A venv without one
# gets this CPU build first (pip finds it on the machine's local wheel cache), so pip never pulls
# a multi-GB CUDA build for a CPU machine. GPU machines bring their own torch.
CPU_TORCH ?= torch==2.13.0
# CuPy for the CUDA major of this machine's driver (cuda12 or cuda13; cuda13 without a driver,
# where the tests use it on the host paths only).
CUDA_EXTRA ?= $(if $(filter 12,$(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1)),cuda12,cuda13)

# The checkout's root stays off sys.path (here and in every child process): `python -m` from it
# would put the top-level kernels/ folder (installed as flashboot.kernels) in front of Hugging
# Face's `kernels` package, which transformers >= 5.25 imports, and break it.
export PYTHONSAFEPATH := 1

# Every download retries: a broken connection to PyPI should cost a retry, not a CI run.
RETRY := requirements/retry.sh
export PIP_RETRIES ?= 10
export PIP_RESUME_RETRIES ?= 10

ENGINES_VENV ?= .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python
ENGINES_REQUIREMENTS := requirements/engines.txt
ENGINE_TESTS := tests/test_integrations_engine_image.py tests/test_integrations_engine_load.py \
	tests/test_integrations_sglang_loader.py tests/test_integrations_sglang_sleep.py \
	tests/test_integrations_sglang_models.py tests/test_integrations_vllm.py tests/test_integrations_refit.py \
	tests/test_engine_gate.py

.PHONY: demo test test-engines soak fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(RETRY) $(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(RETRY) $(PY) -m pip install -q '$(CPU_TORCH)'
	$(RETRY) $(PY) -m pip install -q -e '.[dev,hf,notebooks,$(CUDA_EXTRA)]'
	$(RETRY) $(PY) -m pip install -q --no-deps 'nixl-cu13==1.5.1'  # the [nixl] extra, keeping our torch
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashboot demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

# 500 cycles each of load/bind/close, served load, seed/clone/close, sleep/wake; fails on any upward trend.
soak: $(VENV)/.installed
	$(VENV)/bin/flashboot bench soak --cycles 500

# >= 100,000 mutated inputs per reader of outside bytes; prints tried/parsed/refused/crashes per reader.
FUZZ_INPUTS ?= 100000
fuzz: $(VENV)/.installed
	$(PY) -m flashboot.fuzzing --inputs $(FUZZ_INPUTS) $(FUZZ_ARGS)

# The engine venv: exactly the pinned set (--no-deps: the engines' GPU-only requirements neither
# install nor run on a CPU machine); built once, rebuilt from scratch when the pin file changes.
$(ENGINES_VENV)/.installed: $(ENGINES_REQUIREMENTS)
	rm -rf $(ENGINES_VENV)
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(RETRY) $(ENGINES_PY) -m pip install -q --no-deps -r $(ENGINES_REQUIREMENTS)
	touch $@

# Installs FlashBoot into the engine venv *with* its dependencies, as a user would beside an
# engine, and fails if that changed the engine's torch; then every test_real_* test must pass
# (--require-real-engines: a skipped one fails the run).
test-engines: $(ENGINES_VENV)/.installed
	$(RETRY) $(ENGINES_PY) -m pip install -q -e .
	@want=$$(sed -n 's/^torch==//p' $(ENGINES_REQUIREMENTS)); \
	have=$$($(ENGINES_PY) -c 'import torch; print(torch.__version__.split("+")[0])'); \
	if [ "$$want" != "$$have" ]; then \
		echo "installing flashboot changed the engine venv's torch: pinned $$want, now $$have" >&2; exit 1; fi; \
	echo "flashboot installed beside the engines; torch $$have unchanged"
	$(ENGINES_VENV)/bin/flashboot info
	$(ENGINES_PY) -m pytest -q -rs --require-real-engines $(ENGINE_TESTS)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build *.egg-info
