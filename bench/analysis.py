"""The paper's analyses (a benchmark, not a test): `make bench` runs it after trace.py.

Runs `ffmem analyze` on the default index with the sizes the README's figures use (1,000 held-out
examples; 10 keys a layer × their top 10 triggers for Fig. 3) and reports each analysis's seconds,
and their total over the run's mining pass: its tokens at the mining throughput bench.py measured
earlier in the same `make bench` (bench-results.json → index). Figures go under "analysis".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from results import RESULTS, record  # noqa: E402
from web import default_run  # noqa: E402

from ffmem.config import get_settings  # noqa: E402
from ffmem.engine.model.loading import load_model  # noqa: E402
from ffmem.store import runs  # noqa: E402
from ffmem.store.db import make_engine, make_sessionmaker  # noqa: E402
from ffmem.store.models import Analysis  # noqa: E402
from ffmem.store.specs import AnalysisSpec  # noqa: E402
from ffmem.worker.analysis_jobs import AnalysisOptions, analyze  # noqa: E402

OPTIONS = AnalysisOptions(AnalysisSpec(examples=1000, keys=10, triggers=10, seed=0), progress=False)


def main() -> None:
    settings = get_settings()
    slug, _, _ = default_run(settings.database_url)
    sessions = make_sessionmaker(make_engine(settings.database_url))
    with sessions() as session:
        run = runs.find_finished_run(session=session, model_slug=slug, n_sentences=settings.sentences)
        run_id, run_tokens = run.id, run.n_tokens
    loaded = load_model(settings.model, device="cpu", cache_dir=settings.cache_dir)
    mining_tokens_per_s = json.loads(RESULTS.read_text())["index"]["mining"]["mining_tokens_per_s"]
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
    record("analysis", results)


if __name__ == "__main__":
    main()
