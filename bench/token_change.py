"""TokenChange on the default model: the run's sample and the key page's live call, timed, with the output
scores per depth third against their controls (a benchmark on the real model, not a test).

1. The run's step as a finished run takes it (ffmem.worker.token_changes): `--memories` memories stratified by
   layer, each one's `--contexts` held-out contexts where its key fires most among `--sentences` sentences of
   wiki-vital read after the default index's (so none it mined), its TokenChange in chunks and its output
   score and its control's; the seconds of each part, and the medians per depth third.
2. The live call ("what this memory does"): `--repeats` random memories, each on 16 contexts (the sentences'
   positions where it fires most, among the first 200), timed as the worker runs it
   (ffmem.engine.values.token_change): p50, p95 of wall and CPU time at torch's threads (OMP_NUM_THREADS).
`--memories 0` times the live call only.
Figures go into bench-results.json under "token_change".
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch

from bench import harness
from ffmem.engine.live.protocol import CHANGE_CONTEXTS, CHANGE_FACTOR, CHANGE_TOP
from ffmem.engine.mining.corpus import read_corpus, tokenize
from ffmem.engine.model.loading import load_model
from ffmem.engine.values.token_change import Context, firing_contexts, scored, token_change
from ffmem.worker.token_changes import CHUNK, depth_summary, sample_memories

SKIP = 40_000  # past the bundled corpus's ~36.5K sentences that the default index mines: read after them


def main() -> None:
    parser = harness.parser(__doc__, repeats=20)
    parser.add_argument("--memories", type=int, default=2000)
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--sentences", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    text = read_corpus("wiki-vital")
    held = tokenize(text.sentences[-args.sentences :], loaded.tokenizer)
    sentences = [s.token_ids for s in held]
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    first = [max(s.first_position, 1) for s in held]
    memories = sample_memories(loaded.n_layers, loaded.n_keys, args.memories) if args.memories else []
    run = run_sample(loaded, sentences, first, memories, args.contexts, pad) if memories else {}
    draw = random.Random(0)
    live_memories = [
        (draw.randrange(loaded.n_layers), draw.randrange(loaded.n_keys)) for _ in range(args.repeats)
    ]
    live_contexts = firing_contexts(
        loaded, sentences[:200], first[:200], live_memories, per_memory=CHANGE_CONTEXTS, batch_tokens=4096,
        pad_id=pad,
    )  # fmt: skip
    live, live_cpu = [], []
    for (layer, key), wanted in zip(live_memories, live_contexts, strict=True):
        prefixes = [sentences[c.sentence][: c.position + 1] for c in wanted]  # as the key page sends them
        ends = [[Context(i, len(p) - 1) for i, p in enumerate(prefixes)]]
        begin, begin_cpu = time.perf_counter(), time.process_time()
        found = token_change(loaded, prefixes, [(layer, key)], ends, factor=CHANGE_FACTOR)
        scored(loaded, found, [(layer, key)], CHANGE_TOP)
        live.append(time.perf_counter() - begin)
        live_cpu.append(time.process_time() - begin_cpu)
        harness.log(f"live L{layer}K{key}: {len(prefixes)} contexts, {live[-1]:.3f} s")
    figures = {
        **run,
        "threads": torch.get_num_threads(),
        "live_p50_seconds": round(statistics.median(live), 3),
        "live_p95_seconds": round(sorted(live)[int(0.95 * (len(live) - 1))], 3),
        "live_cpu_p50_seconds": round(statistics.median(live_cpu), 3),
        "load_average": round(os.getloadavg()[0], 1),
    }
    harness.record(args, "token_change", figures)
    print(figures)


def run_sample(loaded, sentences, first, memories, contexts, pad) -> dict:
    """Part 1: the run's step on `memories`, timed by part, with the medians per depth third."""
    start, cpu = time.perf_counter(), time.process_time()
    found_contexts = firing_contexts(
        loaded, sentences, first, memories, per_memory=contexts, batch_tokens=4096, pad_id=pad
    )
    found_seconds = time.perf_counter() - start
    harness.log(
        f"contexts of {len(memories)} memories over {len(sentences)} sentences: {found_seconds:.1f} s"
    )
    rows = []
    for at in range(0, len(memories), CHUNK):
        chunk, wanted = memories[at : at + CHUNK], found_contexts[at : at + CHUNK]
        found = token_change(loaded, sentences, chunk, wanted, factor=CHANGE_FACTOR, probabilities=False)
        for (layer, key), s, n in zip(
            chunk, scored(loaded, found, chunk, CHANGE_TOP), found.contexts, strict=True
        ):
            if n:
                rows.append(
                    dict(layer=layer, key=key, overlap=s.score.overlap, spearman=s.score.spearman,
                         control_overlap=s.control.overlap, control_spearman=s.control.spearman)
                )  # fmt: skip
        harness.log(f"{at + len(chunk)} of {len(memories)} memories, {time.perf_counter() - start:.0f} s")
    return {
        "memories": len(memories),
        "measured": len(rows),
        "contexts": contexts,
        "held_out_sentences": len(sentences),
        "contexts_seconds": round(found_seconds, 1),
        "run_seconds": round(time.perf_counter() - start, 1),
        # CPU time of all its threads: what a shared machine's load hides
        "run_cpu_seconds": round(time.process_time() - cpu, 1),
        **depth_summary(rows, loaded.n_layers),
    }


if __name__ == "__main__":
    main()
