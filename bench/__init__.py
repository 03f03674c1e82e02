"""The benchmarks: scripts that measure ffmem (speed, memory, storage) and validate it on real models, each
run from the repository root as `python -m bench.NAME` (`make bench` runs them in order) and sharing
bench.harness. docs/benchmarks.md holds what they measured."""
