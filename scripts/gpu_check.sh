#!/usr/bin/env bash
# Every GPU check of the TensorRT and ort-cuda backends in one call (< 10 minutes on one GPU), ending with one table.
#
#   scripts/gpu_check.sh                  run from anywhere; OUT=dir keeps logs, JSON and engines (default: a tmp dir)
#   PYTHON=python3.11 scripts/gpu_check.sh
#   LLMC_EXPORT=dir scripts/gpu_check.sh  use an existing SmolLM2 export instead of exporting (offline machines)
#   WHEELS=dir scripts/gpu_check.sh       offline: install llmc's missing dependencies from these wheels
#   AOT_PTX=file scripts/gpu_check.sh     also launch the kernels another machine's Triton wrote
#   (scripts/gpu_carry.sh prepares both where the pinned Triton and a package index are, no GPU needed)
#
# Steps (each with its own time limit; a failed step is a FAIL row, the others still run):
#   1. install   pip install -e '.[export,gpu,dev]' (onnxruntime-gpu in place of onnxruntime), skipped when all
#                import and ONNX Runtime offers CUDA; offline (no package index reachable): llmc from this checkout
#                (its operators built in place) and the wheels in WHEELS, naming what stays missing
#   2. versions  TensorRT, the pinned Triton (TRITON_PIN, checked as the build checks it), cuda-bindings, the ONNX
#                Runtime providers, torch and the CUDA driver: every one reported, a missing one fails the step
#   3. kernels   the Triton attention kernels vs torch scaled_dot_product_attention, fp16, GQA, prefill and decode
#                at several lengths: relative error (<= 1e-2) and time of both, launched from Python and replayed
#                from a CUDA graph (device time alone)
#   4. aot       the plugins' AOT answers launched as TensorRT launches them (tests/trt/aot_launch.py): PTX through
#                the driver, TensorRT's argument order, the aliased caches; slot and paged kernels vs SDPA
#   5. cpu       the CPU checks of the TensorRT path on this machine's packages: recording stand-ins (strongly typed
#                networks, the aliasing preview feature, static KV axes, CUDA graphs per binding, the stream
#                handle), the onnx-static lowering against the in-place reference, the ort-cuda binding plan
#   6. pytest    pytest -m "gpu or trt" tests: tiny TensorRT engines (parity, load checks, present aliased to past,
#                static KV axes, CUDA graphs across re-binds and freed on close) and the tiny ort-cuda engine
#   7. smollm2   export SmolLM2-135M-Instruct (fp32 reference), build fp16 engines with --attention plugin and,
#                where TensorRT >= 10.15, native (the whole-buffer mask), and with --backend ort-cuda; golden check
#   8. bench     llmc bench on each engine: batch 1 and 64, 512 prompt tokens, 64 new tokens
# Steps 7-8 run where TensorRT (or ONNX Runtime's CUDA provider, for ort-cuda) imports, else they are SKIP rows.
# Exit status: 0 all ok, 1 a step failed, 3 none failed but some were skipped (the check is not complete).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/llmc-gpu-check.XXXX)}
mkdir -p "$OUT/logs"
ROWS="$OUT/rows.jsonl"  # the table, one JSON object per row
SUB="$OUT/sub.jsonl"  # rows a step adds under its own (kernel cases, bench runs)
: > "$ROWS"
export PY OUT SUB PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

row() {  # step status seconds detail
  "$PY" -c 'import json,sys; print(json.dumps(dict(zip(["step","status","seconds","detail"], sys.argv[1:]))))' \
    "$@" >> "$ROWS"
}

step() {  # name limit_seconds command...: run, log, add a row (the last line of output as detail)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS status=ok
  : > "$SUB"
  timeout "$limit" bash -c '"$@"' "$name" "$@" > "$OUT/logs/$name.log" 2>&1 || status="FAIL rc=$?"
  row "$name" "$status" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/logs/$name.log" | cut -c1-110)"
  cat "$SUB" >> "$ROWS"
  [ "$status" = ok ]
}

skip() {  # step reason: a row for a step that cannot run here
  row "$1" SKIP 0 "$2"
}

online() {  # is a package index reachable? (3 s)
  "$PY" -c "import socket; socket.create_connection(('pypi.org', 443), timeout=3)" 2>/dev/null
}

install() {
  if "$PY" -c "import tensorrt, triton, torch, onnxruntime_extensions, transformers, llmc, onnxruntime as o, sys
sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    echo "already installed: tensorrt $("$PY" -c 'import tensorrt; print(tensorrt.__version__)')"
    return 0
  fi
  if ! online; then  # llmc from this checkout (PYTHONPATH), its operators built here, the carried wheels
    if [ -d "${WHEELS:-}" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || return 1
    fi
    "$PY" setup.py -q build_ext --inplace -j "$(nproc)" > /dev/null || return 1
    "$PY" - <<'EOF'
import importlib.util, onnxruntime
import llmc.cli.main  # everything the runtime imports
missing = [m for m in ("tensorrt", "triton", "torch", "transformers", "onnxruntime_extensions")
           if importlib.util.find_spec(m) is None]
if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
    missing.append("onnxruntime-gpu")
print("offline: llmc from the checkout" + (f"; missing: {', '.join(missing)}" if missing else ""))
EOF
    return
  fi
  # onnxruntime-gpu and onnxruntime are one `onnxruntime` module: the CPU package goes, the GPU one is reinstalled
  "$PY" -m pip install -q -e '.[export,gpu,dev]' &&
    "$PY" -m pip uninstall -q -y onnxruntime &&
    "$PY" -m pip install -q --force-reinstall --no-deps "$("$PY" -c 'import importlib.metadata as m
print(next(r.split(";")[0].strip() for r in m.requires("llmc") if r.startswith("onnxruntime-gpu")))')" &&
    "$PY" -c "import tensorrt, torch, onnxruntime as o; print('tensorrt', tensorrt.__version__, 'torch',
               torch.__version__, 'cuda', torch.cuda.is_available(), 'ort', o.get_available_providers())"
}

versions() {
  "$PY" - <<'EOF'
import ctypes, importlib.metadata as md, importlib.util, sys
from llmc.engines.trt.build import TRITON_PIN, check_tensorrt, check_triton
found, missing = [], []

def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None

trt = version("tensorrt", "tensorrt-cu13", "tensorrt-cu12")
if trt and importlib.util.find_spec("tensorrt"):
    check_tensorrt(trt, "plugin")
    found.append(f"tensorrt {trt}")
else:
    missing.append("tensorrt")
triton = version("triton")
try:
    check_triton(triton or "0.0")  # the pinned release, as llmc build checks it
    found.append(f"triton {triton}")
except Exception:
    missing.append(f"triton=={'.'.join(map(str, TRITON_PIN))}.* (found {triton})")
bindings = version("cuda-bindings", "cuda-python")
(found if bindings else missing).append(f"cuda-bindings {bindings}" if bindings else "cuda-bindings")
import onnxruntime
providers = onnxruntime.get_available_providers()
found.append(f"onnxruntime {onnxruntime.__version__} ({', '.join(providers)})")
if "CUDAExecutionProvider" not in providers:
    missing.append("onnxruntime-gpu")
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
found.append(f"torch {torch.__version__} ({gpu})")
try:
    driver = ctypes.c_int(0)
    ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
    found.append(f"CUDA driver {driver.value // 1000}.{driver.value % 1000 // 10}")
except OSError:
    missing.append("the CUDA driver (libcuda.so.1)")
print("  ".join(found))
print("missing: " + ", ".join(missing) if missing else "all present")
sys.exit(1 if missing else 0)
EOF
}

kernels() {
  "$PY" - "$SUB" <<'EOF'
import json, sys
from trt.kernel_bench import CASES, compare
worst = 0.0
with open(sys.argv[1], "a") as rows:
    for case in CASES:
        r = compare(*case)
        worst = max(worst, r["rel_err"])
        status = "ok" if r["rel_err"] <= 1e-2 else "FAIL"
        detail = (f"rel err {r['rel_err']:.1e}  triton {r['triton_ms']:.3f} ms  sdpa {r['sdpa_ms']:.3f} ms  "
                  f"({r['triton_ms'] / r['sdpa_ms']:.2f}x)")
        if r["triton_graph_ms"] and r["sdpa_graph_ms"]:  # device time alone, from CUDA-graph replays
            detail += (f"  graphs {r['triton_graph_ms']:.3f} / {r['sdpa_graph_ms']:.3f} ms "
                       f"({r['triton_graph_ms'] / r['sdpa_graph_ms']:.2f}x)")
        name = f"  {r['kind']} b={r['batch']} h={r['heads']} d={r['dim']} t={r['length']}"
        rows.write(json.dumps({"step": name, "status": status, "seconds": "", "detail": detail}) + "\n")
print(f"worst relative error {worst:.1e}")
sys.exit(0 if worst <= 1e-2 else 1)
EOF
}

export_model() {
  if [ -n "${LLMC_EXPORT:-}" ]; then ln -sfn "$LLMC_EXPORT" "$OUT/export"; echo "using $LLMC_EXPORT"; return 0; fi
  "$PY" -m llmc.cli.main export smollm2-135m-instruct -o "$OUT/export" --force
}

build() {  # attention kind
  "$PY" - "$OUT" "$1" <<'EOF'
import json, sys
from pathlib import Path
from llmc.engines.ort.build import BuildConfig
from llmc.engines.trt.build import TrtBuildConfig, build_trt
from llmc.engines.trt.profiles import TrtLimits
out, attention = Path(sys.argv[1]), sys.argv[2]
limits = TrtLimits(max_batch_size=64, max_input_len=512, max_seq_len=640, max_num_tokens=64)
cfg = TrtBuildConfig(BuildConfig(out / "export", out / f"engine-{attention}", backend="trt", force=True), limits,
                     attention=attention)
m = build_trt(cfg)
p = m.settings.parity
print(f"TensorRT {m.settings.tensorrt} on {m.settings.gpu}: golden top-1 {p['top1_agreement']:.0%}, "
      f"greedy match {p['greedy_match']:.0f}, max |logit diff| {p['max_abs_diff']:.2e}")
EOF
}

build_ort_cuda() {
  "$PY" - "$OUT" <<'EOF'
import sys
from pathlib import Path
from llmc.engines.builders import build
from llmc.engines.ort.config import BuildConfig
out = Path(sys.argv[1])
m = build(BuildConfig(out / "export", out / "engine-ort-cuda", backend="ort-cuda", force=True))
p = m.settings.parity
print(f"onnxruntime {m.settings.onnxruntime} CUDA: golden top-1 {p['top1_agreement']:.0%}, "
      f"greedy match {p['greedy_match']:.0f}, max |logit diff| {p['max_abs_diff']:.2e}")
EOF
}

bench() {  # attention kind
  "$PY" -m llmc.cli.main bench "$OUT/engine-$1" --batch-sizes 1,64 --prompt-len 512 --new-tokens 64 --json \
    > "$OUT/bench-$1.jsonl" || return 1
  "$PY" - "$OUT/bench-$1.jsonl" "$SUB" "$1" <<'EOF'
import json, sys
with open(sys.argv[2], "a") as rows:
    for line in open(sys.argv[1]):
        r = json.loads(line)
        detail = (f"ttft {r['ttft_ms']:.2f} ms  decode {r['decode_tok_s_per_seq']:.0f} tok/s/seq  "
                  f"{r['decode_tok_s_aggregate']:.0f} tok/s aggregate")
        rows.write(json.dumps({"step": f"  {sys.argv[3]} b={r['batch']} p={r['prompt_len']}", "status": "ok",
                               "seconds": "", "detail": detail}) + "\n")
print("bench done")
EOF
}

aot() {
  "$PY" -m trt.aot_launch run "${AOT_PTX:-}" "$SUB"
}

export -f online install versions kernels aot export_model build build_ort_cuda bench
START=$SECONDS
step install 240 install
step versions 30 versions
step kernels 90 kernels
step aot 150 aot
# (test_triton_is_pinned asserts this environment has the pinned Triton: the versions step reports that)
step cpu 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/trt/test_trt_calls.py \
  tests/engines/test_onnx_static.py tests/engines/test_ort_cuda.py -m "not gpu and not slow" \
  --deselect tests/trt/test_trt_calls.py::test_triton_is_pinned
# the files holding gpu / trt tests (collecting all of tests/ would need the serve and ray extras too)
step pytest 240 "$PY" -m pytest -m "gpu or trt" tests/trt tests/engines/test_ort_cuda.py -q -rs -p no:cacheprovider
HAS_TRT=0; HAS_ORT_CUDA=0
"$PY" -c "import tensorrt" 2>/dev/null && HAS_TRT=1
"$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
  2>/dev/null && HAS_ORT_CUDA=1
if [ $HAS_TRT = 0 ] && [ $HAS_ORT_CUDA = 0 ]; then
  skip smollm2 "no engine to build: tensorrt does not import and ONNX Runtime offers no CUDA provider"
elif step export 120 export_model; then
  if [ $HAS_TRT = 1 ]; then
    KINDS="plugin"
    "$PY" -c "import tensorrt as t, sys; sys.exit(tuple(map(int, t.__version__.split('.')[:2])) < (10, 15))" \
      2>/dev/null && KINDS="plugin native"
    for kind in $KINDS; do
      step "build-$kind" 150 build "$kind" && step "bench-$kind" 90 bench "$kind"
    done
  else
    skip build-plugin "tensorrt does not import"
  fi
  if [ $HAS_ORT_CUDA = 1 ]; then
    step build-ort-cuda 120 build_ort_cuda && step bench-ort-cuda 90 bench ort-cuda
  else
    skip build-ort-cuda "ONNX Runtime offers no CUDA provider (onnxruntime-gpu is not installed)"
  fi
fi

"$PY" - "$ROWS" "$((SECONDS - START))" "$OUT" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
width = max(len(r["step"]) for r in rows)
print(f"\n{'step':<{width}}  {'status':<10} {'s':>4}  detail")
print("-" * (width + 100))
for r in rows:
    print(f"{r['step']:<{width}}  {r['status']:<10} {r['seconds']:>4}  {r['detail']}")
failed = [r["step"] for r in rows if r["status"] not in ("ok", "SKIP")]
skipped = [r["step"] for r in rows if r["status"] == "SKIP"]
print(f"\n{len(rows) - len(failed) - len(skipped)}/{len(rows)} ok in {sys.argv[2]} s; logs in {sys.argv[3]}/logs"
      + (f"; FAILED: {', '.join(s.strip() for s in failed)}" if failed else "")
      + (f"; SKIPPED: {', '.join(skipped)}" if skipped else ""))
sys.exit(1 if failed else 3 if skipped else 0)
EOF
