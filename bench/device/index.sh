#!/usr/bin/env bash
# `ffmem index` on random-weight models of real shapes, on the GPU machine: bench.device.run_index after
# installing what the machine lacks (bench/device/setup.sh), from .whl/ beside the working tree
# (`make wheelhouse`):
#
#   on the GPU machine:  bash bench/device/index.sh --out $OUT/index.json
#   a dry run on a CPU:  PYTHON=.venv/bin/python bash bench/device/index.sh --device cpu --shapes tiny:2000
#
# Flags go to run_index.py (--shapes, --device, --dtype, --out, --ratio-sentences, …).
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/device/setup.sh
exec "$PYTHON" -m bench.device.run_index "$@"
