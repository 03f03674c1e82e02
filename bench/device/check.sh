#!/usr/bin/env bash
# The whole GPU check in one command (it needs .whl/ beside the working tree, `make wheelhouse`; ~7 minutes
# on an H100), each part's figures in $OUT:
#   1. bench.gpu, parity only: the torch fold on the GPU against the CPU's compiled fold (tiny models,
#      then a random SmolLM2-135M on 256 corpus sentences);                                  gpu.json
#   2. bench.device.run_index: `ffmem index` of the SmolLM2-135M shape over 100K corpus tokens, each
#      stage timed, then mining over the bare forward on the model it loaded;               index.json
#   3. the same ratio alone (no index: storing 458,752 memories takes the CPU ~10 minutes) at the
#      Llama-3.1-8B shape;                                                                  ratio.json
# A dry run on a CPU: PYTHON=.venv/bin/python OUT=/tmp/check SHAPES=tiny:2000 RATIO_SHAPES=tiny \
#   bash bench/device/check.sh --device cpu
#   (the flags go to every script; SHAPES and RATIO_SHAPES override the shapes, PARITY_S the parity's time
#   limit, 0: none).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ffmem-check}
mkdir -p "$OUT"
source bench/device/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
[ "${PARITY_S:-150}" = 0 ] || timeout "${PARITY_S:-150}" "$PYTHON" -m bench.gpu --dtypes "" --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu.log" \
  | grep -E "PASS|FAIL|parity|Error|error" || echo "bench.gpu: stopped or failed (exit ${PIPESTATUS[0]})"
no_bars() { tr '\r' '\n' | grep -v '%|'; }  # the logs keep the progress bars, the output does not
"$PYTHON" -m bench.device.run_index --shapes "${SHAPES:-smollm2-135m:100000}" --out "$OUT/index.json" "$@" 2>&1 \
  | tee "$OUT/index.log" | no_bars
"$PYTHON" -m bench.device.run_index --shapes "${RATIO_SHAPES:-llama-3.1-8b}" --ratio-only --ratio-sentences 3500 \
  --ratio-rounds 2 --out "$OUT/ratio.json" "$@" 2>&1 | tee "$OUT/ratio.log" | no_bars
