# aoe-megatron: every target sets itself up (virtualenv + pinned dependencies from requirements.txt).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help setup test demo params lint clean

help:
	@echo "make demo    - AoE smoke run: a tiny GPTModel learns a fixed batch on the CPU"
	@echo "make test    - the test suite (CPU, gloo; what CI runs)"
	@echo "make params  - total / active parameters of the paper's 732M and 4B models"
	@echo "make setup   - create $(VENV) with the pinned dependencies (done by every target)"
	@echo "make lint    - byte-compile every module (no network needed)"

setup: $(STAMP)

# torch first: deepspeed's setup.py imports it. torch==2.13.0 resolves to the local CPU wheel here.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $$(grep -E '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PY) -m aoe_megatron.smoke --preset tiny --arch aoe --steps 30

params: setup
	$(PY) -m aoe_megatron.params 732m
	$(PY) -m aoe_megatron.params 4b

lint: setup
	$(PY) -m compileall -q aoe_megatron patches tools tests

clean:
	rm -rf $(VENV) build *.egg-info
