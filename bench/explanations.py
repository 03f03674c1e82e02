"""Explanations without an API key on the default index (a benchmark, not a test): `make bench` runs it
after bench.weight_graph (the default index is built first when it is missing).

Describes both sides of every memory of the default run and scores each by the scoring protocol on the
run's held-out sentences (`explain_sentences` of them: each side's top records and the random ones), as a
finished run does (ffmem.worker.explanations.store_explanations; a gated model's sign quadrants too), and
reports the time of each part (target: all memories with their controls in ≤ 10 minutes; wall and CPU
seconds), the medians overall and by depth third with their controls (and per quadrant), per layer
quartiles, and the key page's server time (TestClient, random keys). Figures
go into bench-results.json under "explanations".
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from bench import harness
from ffmem.config import Settings, get_settings
from ffmem.engine.model.loading import load_model
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Explanation, Run
from ffmem.worker.explanations import ExplanationOptions, store_explanations


def page_times(url: str, slug: str, n_layers: int, n_keys: int, samples: int) -> dict:
    """Server time (the Server-Timing header, else wall time) of the key page and its JSON twin."""
    from fastapi.testclient import TestClient

    from ffmem.web.main import create_app

    app = create_app(Settings(database_url=url))
    rng = random.Random(1)
    times = {"key_page": [], "key_page_json": []}
    with TestClient(app) as client:
        for _ in range(samples):
            path = f"/m/{slug}/layers/{rng.randrange(n_layers)}/keys/{rng.randrange(n_keys)}"
            for name, suffix in (("key_page", ""), ("key_page_json", ".json")):
                start = time.perf_counter()
                response = client.get(path + suffix)
                wall = (time.perf_counter() - start) * 1000
                assert response.status_code == 200, response.text
                timing = response.headers.get("server-timing", "")
                server = [float(p.split("dur=")[1]) for p in timing.split(",") if "dur=" in p]
                times[name].append(sum(server) if server else wall)
    app.state.engine.dispose()
    return {name: {"p50_ms": round(statistics.median(t), 1), "n": len(t)} for name, t in times.items()}


def main() -> None:
    parser = harness.parser(__doc__, db=True)
    parser.add_argument("--pages", type=int, default=100, help="key pages timed (0: none)")
    parser.add_argument(
        "--run",
        type=int,
        default=None,
        help="the index run (default: the default run, built first if missing)",
    )
    args = parser.parse_args()
    settings = get_settings()
    url = harness.database_url(args)
    run_id = args.run or harness.default_run(url).id
    sessions = make_sessionmaker(make_engine(url))
    loaded = load_model(settings.model, device="cpu", dtype="float32", cache_dir=settings.cache_dir)
    options = (
        ExplanationOptions.from_settings(settings) if not settings.explainer_url else ExplanationOptions()
    )
    start, cpu = time.perf_counter(), time.process_time()
    summary = store_explanations(sessions, run_id, loaded, options)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    with sessions() as session:
        run = session.get(Run, run_id)
        slug, n_layers, n_keys = run.model.slug, run.model.n_layers, run.model.n_keys
        rows = (
            session.query(Explanation.layer, Explanation.score, Explanation.details)
            .filter_by(run_id=run_id)
            .all()
        )
        best = (
            session.query(Explanation)
            .filter(Explanation.run_id == run_id, Explanation.score.is_not(None))
            .order_by(Explanation.score.desc())
            .limit(5)
            .all()
        )
        examples = [f"L{e.layer} K{e.key} ({e.score:.2f}): {e.text}" for e in best]
    scores = [s for _, s, _ in rows if s is not None]
    results = {
        "memories": len(rows),
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),  # the process's CPU time (every thread's): the machine may be shared
        "parts_seconds": {k: round(v, 1) for k, v in summary.items() if k.endswith("_seconds")},
        "held_out_sentences": summary["held_out_sentences"],
        "top_records": summary["top_records"],
        "random_records": summary["random_records"],
        "scored": len(scores),
        # the protocol's medians (every memory's stronger side) over all and by depth third, with controls
        "medians": summary["medians"],
        "pooled_above_0.3": round(sum(s > 0.3 for s in scores) / max(1, len(scores)), 3),
        "layers": summary["layers"],
        # a gated model's: per sign quadrant, the medians of its memories' quadrant scores, by depth third
        "quadrant_medians": summary.get("quadrant_medians"),
        "examples": examples,
        "target_seconds": 600,
    }
    print(results, flush=True)
    if args.pages:
        results["pages"] = page_times(url, slug, n_layers, n_keys, args.pages)
        print(results["pages"], flush=True)
    harness.record(args, "explanations", results)


if __name__ == "__main__":
    main()
