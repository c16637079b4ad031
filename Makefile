# Everything a fresh machine needs is fetched here, by package name, into a cache outside the
# checkout, so a second run (or a fresh clone on the same machine) neither downloads nor compiles.
SHELL := /bin/bash
PYTHON ?= python3
CACHE ?= $(HOME)/.cache/llmgw
VENV := .venv
PY := $(VENV)/bin/python
LLAMA_CPP_PYTHON := 0.3.36
CONSUL_BIN := $(CACHE)/consul/usr/bin/consul
PROMTOOL_BIN := $(CACHE)/prometheus/usr/bin/promtool
LLAMA_WHEEL_STAMP := $(CACHE)/wheels/.llama-cpp-python-$(LLAMA_CPP_PYTHON)
export LLMGW_CONSUL_BIN := $(CONSUL_BIN)
export LLMGW_PROMTOOL_BIN := $(PROMTOOL_BIN)

.PHONY: setup test lint typecheck pytest demo clean

setup: $(VENV)/.installed $(CONSUL_BIN) $(PROMTOOL_BIN)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# llama.cpp compiles for about four minutes; the wheel is kept so it happens once per machine.
$(LLAMA_WHEEL_STAMP):
	@mkdir -p $(CACHE)/wheels
	@echo "building llama-cpp-python $(LLAMA_CPP_PYTHON) once (compiles llama.cpp, ~4 min on 2 cores)..."
	$(PYTHON) -m pip wheel --no-deps --wheel-dir $(CACHE)/wheels 'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/bin/python $(LLAMA_WHEEL_STAMP)
	$(PY) -m pip install --quiet --find-links $(CACHE)/wheels \
		'llama-cpp-python[server]==$(LLAMA_CPP_PYTHON)' -e '.[dev]'
	@touch $@

$(CONSUL_BIN):
	bash devstack/fetch-deb.sh consul bullseye $(CACHE)/consul
	@test -x $@

$(PROMTOOL_BIN):
	bash devstack/fetch-deb.sh prometheus bookworm $(CACHE)/prometheus
	@test -x $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

pytest: setup
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

demo: setup
	$(PY) -m devstack up

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
