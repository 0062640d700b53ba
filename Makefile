# Two entry points: `make demo` runs the main job, `make test` the tests.
# Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

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

clean:
	rm -rf $(VENV) build *.egg-info
