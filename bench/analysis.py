"""The paper's analyses (a benchmark, not a test): `make bench` runs it after bench.load.

Runs `ffmem analyze` on the default index with the sizes the README's figures use (1,000 held-out
examples; 10 keys a layer × their top 10 triggers for Fig. 3) and reports each analysis's seconds,
and their total over the run's mining pass: its tokens at the mining throughput bench.bench measured
earlier in the same `make bench` (bench-results.json → index). Figures go under "analysis".
"""

from __future__ import annotations

import json

from bench import harness
from ffmem.config import get_settings
from ffmem.engine.model.loading import load_model
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Analysis
from ffmem.store.specs import AnalysisSpec
from ffmem.worker.analysis_jobs import AnalysisOptions, analyze

OPTIONS = AnalysisOptions(AnalysisSpec(examples=1000, keys=10, triggers=10, seed=0), progress=False)


def main() -> None:
    args = harness.parser(__doc__, db=True).parse_args()
    settings = get_settings()
    url = harness.database_url(args)
    run = harness.default_run(url)
    run_id, run_tokens = run.id, run.n_tokens
    sessions = make_sessionmaker(make_engine(url))
    loaded = load_model(settings.model, device="cpu", cache_dir=settings.cache_dir)
    mining_tokens_per_s = json.loads(args.out.read_text())["index"]["mining"]["mining_tokens_per_s"]
    seconds = analyze(sessions, run_id, loaded, OPTIONS)
    mining_seconds = run_tokens / mining_tokens_per_s
    with sessions() as session:
        prefixes = session.get(Analysis, (run_id, "token_removal")).data["prefixes"]
    results = {
        "options": OPTIONS.spec.model_dump(exclude={"seed"}),
        "seconds": {name: round(s, 1) for name, s in seconds.items()},
        "token_removal_prefixes": prefixes,
        "token_removal_ms_per_prefix": round(1000 * seconds["token_removal"] / prefixes, 1),
        "run_tokens": run_tokens,
        "mining_tokens_per_s": round(mining_tokens_per_s, 1),
        "mining_seconds_estimated": round(mining_seconds, 1),
        "analyses_over_mining": round(sum(seconds.values()) / mining_seconds, 2),
    }
    print(results, flush=True)
    harness.record(args, "analysis", results)


if __name__ == "__main__":
    main()
