"""Mining over the bare backbone forward, interleaved in one process, against an older bookkeeping.

    python -m bench.mining_ratio --sentences 1000 --repeats 3
    python -m bench.mining_ratio --primed 2000 --sentences 500 --repeats 3

Per round: the bare backbone forward, mining with `ffmem/engine/mining/state.py` as of git revision
`--against`, mining with the working tree's, and — for a gated model — the working tree's with the sign
quadrants (`quadrants`; its time over `now`'s is what they cost, target ≤ 1.10), in alternating order on the
same batches; prints each round and the medians (wall and process CPU time), after one uncounted bare forward.
On a shared machine only such interleaved ratios mean anything. With `--primed N`, each mining run starts
from the state of the
corpus's first N sentences (mined once per bookkeeping, not timed) and mines the next `--sentences`:
the steady state that most of a whole-corpus run is, where few sentences still enter a key's top-T.
`--against` defaults to 2e3824d, the last torch bookkeeping on a CPU (today's runs the compiled fold,
ffmem.engine.mining.fold_cpu). Figures go into bench-results.json under "mining_filling" (no --primed) or
"mining_steady".
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from bench import harness
from bench.bench import batches_of
from ffmem.config import get_settings
from ffmem.engine.mining import state as mining
from ffmem.engine.mining.batches import mine_batches
from ffmem.engine.mining.corpus import read_corpus
from ffmem.engine.model.loading import load_model


def mining_at(revision: str):
    """ffmem.engine.mining.state as of `revision` (ffmem/engine/mining.py before the engine's folders),
    imported as its own module."""
    return harness.module_at(
        revision, ("ffmem/engine/mining/state.py", "ffmem/engine/mining.py"), "mining_then"
    )


def main() -> None:
    parser = harness.parser(__doc__, repeats=3)
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--against", default="2e3824d", help='git revision of the older mining.py ("": none)')
    parser.add_argument("--primed", type=int, default=0, help="sentences mined before, not timed")
    args = parser.parse_args()
    settings = get_settings()
    loaded = load_model(
        settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir
    )
    sentences = read_corpus("wiki-vital", args.primed + args.sentences).sentences
    primer = batches_of(loaded, sentences[: args.primed], settings)
    batches = batches_of(loaded, sentences[args.primed :], settings)
    for b in batches:
        b.sentence_index += args.primed  # [batch]: the corpus's own indices
    tokens = sum(b.real_tokens for b in batches)
    print(
        f"{len(batches)} batches, {tokens} tokens after {len(primer)} batches of {args.primed} primed "
        f"sentences, {torch.get_num_threads()} threads"
    )

    def bare() -> None:
        with torch.inference_mode():
            for b in batches:
                loaded.model.base_model(
                    input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False
                )

    def miner(module, **gated):
        primed = module.MiningState(
            loaded.n_layers, loaded.n_keys, settings.top_k, device=loaded.device, **gated
        )
        fold = getattr(module, "mine_batches", mine_batches)  # an older module had its own
        fold(loaded, primer, primed)

        def run() -> None:
            fold(loaded, batches, copy.deepcopy(primed))

        return run

    runs = {"bare": bare, "now": miner(mining)}
    if args.against:
        runs["then"] = miner(mining_at(args.against))
    if loaded.adapter.gates is not None:
        runs["quadrants"] = miner(mining, gated=True)
    bare()  # warm-up, not counted: the first forward after loading is much slower
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for round_ in range(args.repeats):
        for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        last = {name: times[-1] for name, times in wall.items()}
        print(
            f"round {round_}: "
            + ", ".join(f"{name} {t:.2f} s" for name, t in last.items())
            + "; over bare: "
            + ", ".join(f"{name} {last['bare'] / t:.3f}" for name, t in last.items() if name != "bare")
            + (f"; quadrants over now {last['quadrants'] / last['now']:.3f}" if "quadrants" in last else "")
        )
    figures = {"against": args.against, "primed": args.primed, "batches": len(batches), "tokens": tokens}
    for label, times in (("wall", wall), ("cpu", cpu)):
        m = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"median {label}: "
            + ", ".join(f"{name} {t:.2f} s" for name, t in m.items())
            + "; mining over the bare backbone forward: "
            + ", ".join(f"{name} {m['bare'] / t:.3f}" for name, t in m.items() if name != "bare")
        )
        figures[label] = {name: round(seconds, 2) for name, seconds in m.items()}
        figures[f"{label}_ratio"] = {name: round(m["bare"] / m[name], 3) for name in runs if name != "bare"}
        if "quadrants" in m:
            print(f"quadrants: {m['quadrants'] / m['now']:.3f}× the mining without them ({label})")
            figures[f"{label}_quadrants_cost"] = round(m["quadrants"] / m["now"], 3)
    harness.record(args, "mining_steady" if args.primed else "mining_filling", figures)


if __name__ == "__main__":
    main()
