# Entry points: `make demo` runs the main job, `make test` the tests, `make fuzz` the long fuzz campaign.
# Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test soak fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,hf,notebooks]'
	$(PY) -m pip install -q --no-deps 'nixl-cu13==1.5.1'  # the [nixl] extra, keeping our torch
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashboot demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

# 500 cycles each of load/bind/close, served load, seed/clone/close; fails on any upward trend.
soak: $(VENV)/.installed
	$(VENV)/bin/flashboot bench soak --cycles 500

# >= 100,000 mutated inputs per reader of outside bytes; prints tried/parsed/refused/crashes per reader.
FUZZ_INPUTS ?= 100000
fuzz: $(VENV)/.installed
	$(PY) -m flashboot.fuzzing --inputs $(FUZZ_INPUTS) $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
