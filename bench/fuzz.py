"""The fuzz test at ten times its CI size (a benchmark, not a test): `make bench` runs it last.

Runs tests/web/test_fuzz.py's `test_operation` (Schemathesis over /openapi.json, on the tiny index,
SQLite and Postgres) with FFMEM_FUZZ_EXAMPLES ten times the test's default, reads what each
operation sent from the JUnit report, and records under "fuzz" in bench-results.json: operations,
cases sent, failures (operations where a check failed, named) per backend, and the seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench import harness

SCALE = 10
CI_EXAMPLES = 20  # tests/web/test_fuzz.py's default


def main() -> None:
    args = harness.parser(__doc__).parse_args()
    examples = SCALE * CI_EXAMPLES
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "fuzz.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "tests/web/test_fuzz.py::test_operation",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit1",
        ]
        start = time.perf_counter()
        run = subprocess.run(
            command, cwd=harness.ROOT, env=os.environ | {"FFMEM_FUZZ_EXAMPLES": str(examples)}
        )
        seconds = time.perf_counter() - start
        backends = summarize(ET.parse(report))
    results = {"examples_per_operation": examples, "seconds": round(seconds, 1), **backends}
    harness.record(args, "fuzz", results)
    for backend, figures in backends.items():
        print(
            f"{backend}: {figures['operations']} operations, {figures['cases']:,} cases, "
            f"{len(figures['failures'])} failures"
        )
    if run.returncode not in (0, 1):  # 1: some operation failed, recorded above
        raise SystemExit(run.returncode)


def summarize(report: ET.ElementTree) -> dict:
    """Per backend: operations, cases sent and the operations that failed, from the JUnit report."""
    backends: dict[str, dict] = {}
    for case in report.iter("testcase"):
        if case.find("skipped") is not None:  # Postgres not reachable
            continue
        backend, operation = case.get("name").removeprefix("test_operation[").removesuffix("]").split("-", 1)
        figures = backends.setdefault(backend, {"operations": 0, "cases": 0, "failures": []})
        figures["operations"] += 1
        figures["cases"] += sum(
            int(p.get("value")) for p in case.iter("property") if p.get("name") == "cases"
        )
        if case.find("failure") is not None or case.find("error") is not None:
            figures["failures"].append(operation)
    return backends


if __name__ == "__main__":
    main()
