#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that reaches no package index, prepared on this one:
#   scripts/gpu_carry.sh [DIR]      (DIR default .gpu, git-ignored; PYVER=3.12 the GPU machine's Python)
# writes DIR/wheels (llmc's dependencies such a machine's image lacks, for its Python) and DIR/aot_triton.jsonl (the
# plugins' AOT answers written by this machine's Triton, the pinned release: no GPU needed). Then, there:
#   WHEELS=DIR/wheels AOT_PTX=DIR/aot_triton.jsonl scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
PYVER=${PYVER:-3.12}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$DIR/wheels"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DIR/wheels" llguidance onnxruntime-extensions gguf
PYTHONPATH="tests:.${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1 "$PY" -m trt.aot_launch save "$DIR/aot_triton.jsonl"
ls -la "$DIR/wheels" "$DIR/aot_triton.jsonl"
echo "carry $DIR, then run there: WHEELS=$DIR/wheels AOT_PTX=$DIR/aot_triton.jsonl scripts/gpu_check.sh"
