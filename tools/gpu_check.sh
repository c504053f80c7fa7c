#!/usr/bin/env bash
# The one prepared GPU check (issue #19): tools/gpu_check.py's steps (environment, gpu-marked tests,
# a tiny bf16 run that saves, resumes and verifies, AoE vs MoE tokens/s, a cut-down layer bench),
# in at most 5 minutes on one H200, results written as it goes.
#
#   tools/gpu_check.sh [--out DIR]     # on a CUDA machine; DIR defaults to $OUT, else bench/gpu_check
#   tools/gpu_check.sh --cpu           # the same steps on the CPU at tiny shapes (make test runs it)
#
# Python: the repo's .venv when there is one, else python3. A machine without megatron-core or
# DeepSpeed (the lent GPU machine: Python 3.12, CUDA torch) gets them from the wheels `make
# gpu-wheels` put into .whl/ (carried there by the device tool), installed into a scratch folder.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
SITE="${GPU_CHECK_SITE:-/tmp/aoe-gpu-check-site}"

if ! "$PY" -c 'import megatron.core, deepspeed' 2>/dev/null; then
  shopt -s nullglob
  wheels=("$ROOT"/.whl/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_check.sh: $PY has no megatron-core/DeepSpeed and there are no wheels in .whl/" \
         "(run 'make gpu-wheels' and carry .whl)" >&2
    exit 2
  fi
  echo "gpu_check.sh: installing ${#wheels[@]} carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}"
  # the checkout first: its presets and configs sit beside the code (the installed copy of our
  # own package only shows that it installs there)
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
cd "$ROOT"
exec "$PY" tools/gpu_check.py "$@"
