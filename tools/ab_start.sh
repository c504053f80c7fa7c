#!/usr/bin/env bash
# Does a change make training start slower? A world-1 tiny run of 2 steps (--mock-data), wall
# seconds, this checkout against git ref BASE (a temporary worktree), alternating, ROUNDS rounds,
# both on this checkout's .venv (PY). Prints every sample, then median, min and max per side.
#
#   tools/ab_start.sh BASE [ROUNDS]        e.g. tools/ab_start.sh df2be68 5
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_REF="${1:?usage: tools/ab_start.sh BASE [ROUNDS]}"
ROUNDS="${2:-5}"
PY="${PY:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d)"
trap 'git -C "$ROOT" worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add -q --detach "$WORK/base" "$BASE_REF"
export AOE_MEGATRON_ASSETS="${AOE_MEGATRON_ASSETS:-$ROOT/assets}" OMP_NUM_THREADS=2
for r in $(seq "$ROUNDS"); do
  for side in "$WORK/base" "$ROOT"; do
    started=$(date +%s.%N)
    (cd "$side" && PYTHONPATH="$side" "$PY" -m aoe_megatron.train --preset tiny --mock-data \
       --train-iters 2 --eval-interval 0 --run-dir "$WORK/run-$r" >/dev/null 2>&1)
    echo "$([ "$side" = "$ROOT" ] && echo head || echo "$BASE_REF") $(echo "$(date +%s.%N) - $started" | bc)"
    rm -rf "$WORK/run-$r"
  done
done | tee "$WORK/samples"
"$PY" - "$WORK/samples" <<'PYEOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
for side in dict.fromkeys(name for name, _ in rows):
    v = [float(s) for name, s in rows if name == side]
    print(f"{side}: median {statistics.median(v):.2f} s, min {min(v):.2f}, max {max(v):.2f} ({len(v)} runs)")
PYEOF
