#!/usr/bin/env bash
# `make gpu-wheels`: what tools/gpu_check.sh needs on the lent GPU machine (Python 3.12, CUDA torch,
# transformers, sentencepiece, tensorboard, ... but no megatron-core or DeepSpeed, and no network),
# as wheels in .whl/ (git-ignored), for the device tool to carry:
#   - cp312 wheels of megatron-core at each supported release, one folder each
#     (.whl/megatron-core-0.19.2/, .whl/megatron-core-0.16.1/: tools/gpu_check.sh installs one,
#     GPU_CHECK_MCORE selects it), and of DeepSpeed's pure-Python needs that image lacks, at the
#     versions this .venv runs (requirements.txt pins them);
#   - DeepSpeed built from its source distribution (PyPI has no DeepSpeed wheel), without its C++
#     ops (DeepSpeed compiles them when first used);
#   - our own package (installed there with --no-deps).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DEST="${WHEEL_DIR:-$ROOT/.whl}"
# What the GPU image lacks (the device tool's KINDS.md lists what it has).
BINARY=(pydantic pydantic-core annotated-types typing-inspection hjson)
# The supported megatron-core releases (aoe_megatron/runtime/versions.py), newest first.
MCORE=($("$PY" -c "from aoe_megatron.runtime.versions import SUPPORTED_MCORE as s; print(*reversed(s))"))

version() { "$PY" -c "import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))" "$1"; }

rm -rf "$DEST"
mkdir -p "$DEST"
specs=()
for name in "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
download() {  # DIR SPEC...
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$@"
}
echo "gpu-wheels: ${specs[*]} (cp312)"
download "$DEST" "${specs[@]}"
for release in "${MCORE[@]}"; do
  echo "gpu-wheels: megatron-core==$release (cp312)"
  download "$DEST/megatron-core-$release" "megatron-core==$release"
done
echo "gpu-wheels: deepspeed==$(version deepspeed) from its source distribution"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-binary deepspeed \
  -w "$DEST" "deepspeed==$(version deepspeed)"
echo "gpu-wheels: aoe-megatron"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" "$ROOT"
rm -rf "$ROOT/build"
ls -1R "$DEST"
du -sh "$DEST"
