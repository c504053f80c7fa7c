#!/usr/bin/env bash
# The one prepared GPU check (issues #19, #34): tools/gpu_check.py's steps (environment, gpu-marked
# tests, EP=2 over NCCL with two ranks on the one GPU saving, resuming and against EP=1, the layer
# bench's 732M and 4B blocks, the 12-layer 732M model through the trainer: tokens/s, peak memory,
# MFU against the datasheet and a measured matmul; activation memory per layer at 4B), within
# 6 minutes on one H100 or H200 (the steps' budget 330 s, the rest for installing the wheels),
# results written after each step. docs/gpu.md#the-gpu-check says how to read them.
#
#   tools/gpu_check.sh [--out DIR]     # on a CUDA machine; DIR defaults to $OUT, else bench/gpu_check
#   tools/gpu_check.sh --cpu           # the same steps on the CPU at tiny shapes (make test runs it)
#   tools/gpu_check.sh --steps ep-nccl,layer   # only these steps (--skip layer: the others)
#   GPU_CHECK_MCORE=0.16.1 tools/gpu_check.sh   # on the older supported megatron-core (default 0.19.2)
#
# Python: PY, else the virtualenv of the CI leg that runs GPU_CHECK_MCORE (.venv-mcore019 for
# 0.19.2, .venv for 0.16.1) when there is one, else python3; its megatron-core must be that
# release. A machine without megatron-core or
# DeepSpeed (the lent GPU machine: Python 3.12, CUDA torch) gets them from the wheels `make
# gpu-wheels` put into .whl/ (carried there by the device tool), installed into a scratch folder:
# megatron-core at GPU_CHECK_MCORE (0.19.2 unless set; the environment step records the versions).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MCORE="${GPU_CHECK_MCORE:-0.19.2}"
# The virtualenv of the leg that runs this megatron-core, where there is one (make setup,
# make setup-mcore019), else python3.
case "$MCORE" in
  0.16.1) VENV_PY="$ROOT/.venv/bin/python" ;;
  *) VENV_PY="$ROOT/.venv-mcore019/bin/python" ;;
esac
PY="${PY:-$VENV_PY}"
[ -x "$PY" ] || PY="$(command -v python3)"
SITE="${GPU_CHECK_SITE:-/tmp/aoe-gpu-check-site-$MCORE}"

if ! "$PY" -c 'import megatron.core, deepspeed' >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=("$ROOT"/.whl/*.whl)
  release=("$ROOT/.whl/megatron-core-$MCORE"/*.whl)
  if [ ${#wheels[@]} -eq 0 ] || [ ${#release[@]} -eq 0 ]; then
    echo "gpu_check.sh: $PY has no megatron-core/DeepSpeed and .whl/ has no wheels for" \
         "megatron-core $MCORE (run 'make gpu-wheels' and carry .whl)" >&2
    exit 2
  fi
  wheels+=("${release[@]}")
  echo "gpu_check.sh: installing ${#wheels[@]} carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}"
  # the checkout first: its presets and configs sit beside the code (the installed copy of our
  # own package only shows that it installs there)
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
found="$("$PY" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)"
if [ "$found" != "$MCORE" ]; then
  echo "gpu_check.sh: $PY has megatron-core ${found:-(none)}, not $MCORE (GPU_CHECK_MCORE):" \
       "set GPU_CHECK_MCORE=$found, or PY to a Python with $MCORE" >&2
  exit 2
fi
# The layer step's fair MoE baseline (the bench's moe-grouped arm: megatron-core's legacy grouped
# GEMM) exists on 0.16.1 only: with another release, that step runs on a 0.16.1 Python (.venv) or
# on 0.16.1's carried wheel in a scratch folder beside this one (GPU_CHECK_LAYER_PY / _PYTHONPATH;
# the step records the release it ran). Without either, the arm is reported not measured.
LAYER_MCORE=0.16.1
if [ "$MCORE" != "$LAYER_MCORE" ] && [ -z "${GPU_CHECK_LAYER_PY:-}" ]; then
  shopt -s nullglob
  older=("$ROOT/.whl/megatron-core-$LAYER_MCORE"/*.whl)
  if "$ROOT/.venv/bin/python" -c 'import importlib.metadata as m, sys
sys.exit(m.version("megatron-core") != "'"$LAYER_MCORE"'")' >/dev/null 2>&1; then
    export GPU_CHECK_LAYER_PY="$ROOT/.venv/bin/python"
  elif [ ${#older[@]} -gt 0 ]; then
    # megatron-core alone, ahead of everything else on the path (the other wheels are shared)
    LAYER_SITE="${GPU_CHECK_LAYER_SITE:-/tmp/aoe-gpu-check-mcore-$LAYER_MCORE}"
    echo "gpu_check.sh: the layer step on megatron-core $LAYER_MCORE: installing it into $LAYER_SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$LAYER_SITE" "${older[@]}"
    export GPU_CHECK_LAYER_PY="$PY" GPU_CHECK_LAYER_PYTHONPATH="$ROOT:$LAYER_SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONUNBUFFERED=1
cd "$ROOT"
exec "$PY" tools/gpu_check.py "$@"
