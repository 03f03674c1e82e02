#!/usr/bin/env bash
# The whole GPU check in one command, ≤ 9 minutes (each part under its own time limit, the sum 9 minutes),
# each part's figures in $OUT. It needs .whl/ beside the working tree (`make wheelhouse`).
#   1. bench.gpu, parity only: the torch fold on the GPU against the CPU's compiled fold, tiny models,
#      then a random SmolLM2-135M on 256 corpus sentences (top-T slots and quadrant examples: a tie told
#      from an error);                                                          gpu.json    PARITY_S=90
#   2. `ffmem index` of the Llama-3.1-8B shape over 1M corpus tokens, every stage's time and peak GPU and
#      host memory, then on the model it loaded mining over the bare forward and a live trace of a
#      32-token prompt (p50, p95);                                              index.json  INDEX_S=330
#   3. mining over the bare forward at the SmolLM2-135M and Qwen3-32B shapes (64 × 25,600 memories,
#      151,936 tokens; 64 GB in bf16, built in the GPU's memory, never written);  ratio.json  RATIO_S=120
# The dry run on a CPU, tiny shapes (what tests/bench/test_device_check.py runs):
#   DRY_RUN=1 PYTHON=.venv/bin/python OUT=/tmp/check bash bench/device/check.sh
# Flags go to every script; SHAPES and RATIO_SHAPES override the shapes of parts 2 and 3, a part's *_S its
# time limit (0: the part is skipped), WORK run_index's folder of models and databases, FOLD the torch fold's
# lists in parity and ratios: merge (the default) or bar (the bar form, ffmem/engine/mining/fold_torch.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ffmem-check}
mkdir -p "$OUT"
source bench/device/setup.sh
if [ "${DRY_RUN:-0}" = 1 ]; then  # tiny shapes on the CPU: every part, in seconds
  DEVICE=(--device cpu)
  PARITY=(--parity-sentences 0 --dtypes "")
  SHAPES=${SHAPES:-tiny:2000}
  RATIO_SHAPES=${RATIO_SHAPES:-tiny}
  RATIO=(--ratio-sentences 40 --ratio-rounds 1 --trace-repeats 2)
  LIMIT=900  # a part's default limit: a loaded CPU is slow
  # The tiny index's run-level samples cut to what shows they run (the defaults, 2,000 TokenChange memories and
  # 1,000 held-out sentences, would take most of the dry run on a CPU)
  export FFMEM_TOKEN_CHANGE_MEMORIES=${FFMEM_TOKEN_CHANGE_MEMORIES:-6} FFMEM_EXPLAIN_SENTENCES=${FFMEM_EXPLAIN_SENTENCES:-20}
else
  DEVICE=()
  PARITY=(--dtypes "")
  RATIO=(--ratio-sentences 2000 --ratio-rounds 2 --ratio-budget-s 60 --trace-repeats 20)
  LIMIT=
fi
WORK=(--work "${WORK:-/tmp/ffmem-device}")  # run_index's models and databases
FOLD=(--fold "${FOLD:-merge}")  # the torch fold's lists: merge or bar
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
echo "$(nproc) CPU cores"
no_bars() { tr '\r' '\n' | grep -v '%|'; }  # the logs keep the progress bars, the output does not
part() {  # part NAME LIMIT_S COMMAND…: run it under its limit, its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  [ "$limit" = 0 ] && { echo "$name: skipped"; return; }
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | no_bars
  local code=${PIPESTATUS[0]}
  echo "$name: exit $code after $((SECONDS - start)) s (limit ${limit} s)"
}
part gpu "${PARITY_S:-${LIMIT:-90}}" "$PYTHON" -m bench.gpu "${PARITY[@]}" "${DEVICE[@]}" "${FOLD[@]}" --out "$OUT/gpu.json" "$@"
part index "${INDEX_S:-${LIMIT:-330}}" "$PYTHON" -m bench.device.run_index --shapes "${SHAPES:-llama-3.1-8b:1000000}" \
  "${RATIO[@]}" "${WORK[@]}" "${DEVICE[@]}" "${FOLD[@]}" --out "$OUT/index.json" "$@"
part ratio "${RATIO_S:-${LIMIT:-120}}" "$PYTHON" -m bench.device.run_index --shapes "${RATIO_SHAPES:-smollm2-135m,qwen3-32b}" \
  --ratio-only --in-memory "${RATIO[@]}" --trace-repeats 0 "${WORK[@]}" "${DEVICE[@]}" "${FOLD[@]}" \
  --out "$OUT/ratio.json" "$@"
