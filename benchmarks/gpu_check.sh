#!/usr/bin/env bash
# The CUDA target end to end on a lent GPU, in under 8 minutes of wall time.
#
#   here:    python benchmarks/gpu_wheels.py          (once: .whl/, the wheels the device lacks)
#   device:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   dry run: GPU_CHECK_TARGET=cpu OUT=/tmp/gc bash benchmarks/gpu_check.sh   (tests/test_gpu_check.py;
#            GPU_CHECK_WHEELS=0 uses the interpreter's own packages instead of .whl, which holds
#            CPython 3.12 wheels for the device)
#
# Installs the carried wheels into /tmp/site (quantlab itself runs from this tree,
# no install), then runs three sweeps with tracking into $OUT/mlflow.db:
#   +sweep=launch_overhead  compile / CUDA graphs for bf16, fp8-w8a8, int4: P50 and P99 per token
#   +sweep=fp8_vs_int4      the weight schemes, eager (real FP8 W8A8 on SM >= 8.9, torchao int4/int8)
#   +sweep=kv               the KV-cache schemes on bf16 weights
#   +sweep=formats          the block-scaled formats (FP8 blocks, NVFP4, MXFP4/MXFP8, W4A8) on the CUDA engine:
#                           emulated there (dequantized in fp32), so this checks they run and what they cost
#                           emulated; with a CUDA vLLM venv (below) they are also served by vLLM's own kernels
#   vllm                    +sweep=fp8_vs_int4 target=vllm target.device=cuda (bf16, fp8-w8a8, int8, int4-g64,
#                           quantlab's exports served by vLLM's CUDA kernels), only where QUANTLAB_VLLM_PYTHON
#                           names a CUDA vLLM venv there (VLLM_PACKAGE=vllm==<version pinning torch 2.13> bash
#                           scripts/build_vllm_venv.sh: its wheels are over the device's 64 MiB carry, so the
#                           check says it skipped it otherwise)
# (GPU_CHECK_SWEEPS="kv" runs a subset; GPU_CHECK_SWEEP_S=N replaces every sweep's limit)
# and writes $OUT/gpu_report.md: the capability matrix seen there and each sweep's report.
# The model is SmolLM2-135M's shape with random weights (its GGUF, 92 MB, is over
# the 64 MiB carry): kernels, latency and KL against its fp32 self are real,
# accuracy is not the point. Each sweep has a time limit; one that hits it
# leaves the points it finished and the report says so.
set -uo pipefail
cd "$(dirname "$0")/.."
fail() { echo "gpu_check: $*" >&2; exit 2; }
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
: "${OUT:?gpu_check: OUT is not set (the device tool sets it; for a dry run set it yourself)}"
TARGET=${GPU_CHECK_TARGET:-cuda}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
SWEEPS=" ${GPU_CHECK_SWEEPS:-launch_overhead fp8_vs_int4 kv formats vllm} "   # a subset reruns one part
start=$(date +%s)

command -v "$PY" >/dev/null || fail "no $PY on PATH"
"$PY" -c "import torch, transformers" 2>/dev/null || fail "$PY cannot import torch and transformers"
if [ "$TARGET" = cuda ]; then
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || fail "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA device"
fi
if ls .whl/*.whl >/dev/null 2>&1 && [ "${GPU_CHECK_WHEELS:-1}" = 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || fail "installing the carried wheels into $SITE failed"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$TARGET" = cuda ]; then
  fail ".whl/ is empty: run 'python benchmarks/gpu_wheels.py' here and carry .whl"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import hydra, mlflow, sqlalchemy" 2>/dev/null || fail "hydra/mlflow/sqlalchemy not importable after install"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore QUANTLAB_CACHE=/tmp/quantlab-cache
STORE="sqlite:///$OUT/mlflow.db"
MODEL=(model=tiny model.name=smollm2-shape model.tiny.hidden_size=576 model.tiny.intermediate_size=1536
       model.tiny.num_hidden_layers=${GPU_CHECK_LAYERS:-30} model.tiny.num_attention_heads=9
       model.tiny.num_key_value_heads=3 model.tiny.max_position_embeddings=2048)
COMMON=("${MODEL[@]}" "tracking.uri=$STORE" "tracking.artifact_root=/tmp/quantlab-artifacts" probe=smoke)

sweep() {  # name (its sweep_name), preset, time limit in seconds, then overrides
  local name=$1 preset=$2 limit=${GPU_CHECK_SWEEP_S:-$3}; shift 3
  [[ "$SWEEPS" == *" $name "* ]] || return 0
  log "sweep $name, at most $limit s ($*)"
  timeout "$limit" "$PY" -m quantlab "+sweep=$preset" "sweep_name=$name" "${COMMON[@]}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "sweep $name: stopped at its ${limit} s limit" >>"$OUT/notes.txt"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo "sweep $name: exit $rc ($(grep -v '^\s*$' "$OUT/$name.log" | tail -1))" \
    >>"$OUT/notes.txt"
  log "sweep $name: exit $rc"
}
# (a sweep value given on the command line replaces the preset's list for that key)
# Measured on an H200 (2026-12-01): the eager weight sweep takes 90 s; one compiled
# point (inductor over 30 layers) takes over 100 s, so the compiled sweep gets the
# most time and leaves eager to fp8_vs_int4.
if [ "$TARGET" = cuda ]; then
  sweep launch_overhead launch_overhead 250 target=cuda-graphs,cuda-compile scheme/weights=bf16,fp8-w8a8,int4-g64 \
    probe.latency.repeats=5 probe.latency.new_tokens=64
  sweep fp8_vs_int4 fp8_vs_int4 100 target=cuda \
    scheme/weights=fp32,bf16,fp16,fp8-e4m3,fp8-w8a8,int8,int4-g64,int4-g32,nf4
  sweep kv kv 90 target=cuda probe.cache.corpus=builtin scheme/weights=bf16
  # quantlab's CUDA engine emulates these formats: timed anyway here, to show the emulation's decode runs on CUDA
  sweep formats formats 120 target=cuda scheme/weights=bf16,fp8-block64,nvfp4,nvfp4-a16,mxfp4,mxfp8,w4a8-g64 \
    probe.latency.on_emulated=measure
else  # dry run: the same sweeps and wiring on the CPU, two points each
  sweep launch_overhead launch_overhead 300 target=cpu scheme/weights=bf16,int8 probe.latency.repeats=1 \
    probe.latency.new_tokens=4
  sweep fp8_vs_int4 fp8_vs_int4 300 target=cpu scheme/weights=bf16,fp8-w8a8 probe.latency.repeats=1
  sweep kv kv 300 target=cpu probe.cache.corpus=builtin scheme/weights=bf16 scheme/kv=none,int8 probe.latency.repeats=1
  sweep formats formats 300 target=cpu scheme/weights=bf16,nvfp4-a16 probe.latency.repeats=1
fi
if [[ "$SWEEPS" == *" vllm "* ]]; then
  if [ "$TARGET" = cuda ] && [ -n "${QUANTLAB_VLLM_PYTHON:-}" ]; then  # a vLLM server start is about a minute a point
    sweep vllm fp8_vs_int4 300 target=vllm target.device=cuda scheme/weights=bf16,fp8-w8a8,int8,int4-g64
    # the block-scaled formats through vLLM's CUDA kernels (FP8 blocks SM89+, W4A8 SM90, NVFP4/MXFP4 SM100)
    SWEEPS="$SWEEPS vllm_formats "
    sweep vllm_formats formats 300 target=vllm target.device=cuda \
      scheme/weights=bf16,fp8-block64,w4a8-g64,nvfp4-a16,nvfp4,mxfp4-a16
  else
    echo "sweep vllm: skipped (needs target cuda and QUANTLAB_VLLM_PYTHON, a CUDA vLLM venv on this machine)" \
      >>"$OUT/notes.txt"
    SWEEPS=${SWEEPS/ vllm / }
  fi
fi

{
  echo "# GPU check ($TARGET) — $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  "$PY" -c "import torch; print('torch', torch.__version__, '| device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  [ -f "$OUT/notes.txt" ] && cat "$OUT/notes.txt"
  echo; echo "## Capability matrix"; echo
  "$PY" -m quantlab.capabilities 2>/dev/null
  for name in $SWEEPS; do
    echo; echo "## $name"; echo
    "$PY" -m quantlab.report --tracking-uri "$STORE" --sweep "$name" --no-log --out "/tmp/gpu-report-$name" \
      2>/dev/null || echo "(no report: see $name.log)"
  done
} >"$OUT/gpu_report.md"
log "done in $(( $(date +%s) - start )) s: $OUT/gpu_report.md, $OUT/mlflow.db"
