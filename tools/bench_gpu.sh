#!/usr/bin/env bash
# `make bench` on one CUDA device in under 8 minutes: bf16, the 732m and fine64 (64-expert) layer
# shapes and the model level, megatron-core's TransformerEngine spec (grouped GEMM) when TE is
# installed. EP=2 needs two devices and is left out.
#
#   tools/bench_gpu.sh                    # results in bench/gpu/
#   tools/bench_gpu.sh --cpu              # the quick CPU version (BENCH_DEVICE=cpu does the same)
#   tools/bench_gpu.sh --reps 10 --out X  # any further flags go to tools/bench.py (later wins)
#
# Settings (environment): BENCH_DEVICE=cuda|cpu, BENCH_REPS (20), BENCH_OUT (bench/gpu),
# BENCH_TIMEOUT seconds (480), PY (the repo's .venv python when present).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
BENCH_DEVICE="${BENCH_DEVICE:-cuda}"
BENCH_REPS="${BENCH_REPS:-20}"
BENCH_OUT="${BENCH_OUT:-$ROOT/bench/gpu}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-480}"

passthrough=()
for arg in "$@"; do
  case "$arg" in
    --cpu) BENCH_DEVICE=cpu ;;
    *) passthrough+=("$arg") ;;
  esac
done

case "$BENCH_DEVICE" in
  cuda) common=(--device cuda --dtype bf16 --shapes 732m,fine64 --only layer,model
                --reps "$BENCH_REPS" --out "$BENCH_OUT") ;;
  cpu) export CUDA_VISIBLE_DEVICES=""
       common=(--device cpu --quick --only layer,model --out "$BENCH_OUT") ;;
  *) echo "BENCH_DEVICE must be cuda or cpu, got '$BENCH_DEVICE'" >&2; exit 2 ;;
esac

cd "$ROOT"
echo "tools/bench_gpu.sh: $PY tools/bench.py ${common[*]} ${passthrough[*]:-}"
exec timeout --signal=INT "$BENCH_TIMEOUT" "$PY" tools/bench.py "${common[@]}" "${passthrough[@]}"
