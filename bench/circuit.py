"""A prompt's memory circuit (ffmem.engine.live.circuit): whether its edges mean something, and its cost (a
validation and a benchmark on the real model, not a test): `make bench` runs it.

1. Validation by ablation, as bench.weight_graph validates the weight graph: on `--prompts` Wikipedia
   sentences (12–40 tokens, the last position, the prediction as the target) the circuit with the defaults
   (10 memories that push the target, 5 upstream each, threshold 0.1, one hop); up to `--edges` of its edges
   sampled per prompt. For each edge j → i, memory j is switched off (m_j = 0 at every position,
   ffmem.engine.live.edited_forward) and the change of m_i at the position is compared with the term's
   prediction, −sign(term); for a random memory of the same layer as j (and the same i), the same with
   its own term m_j'·(v_j'·ρ_i). The two rates of agreement (a meaningless term would put both at 50%), the
   rates of a change that agrees and is at least `MEANINGFUL` of |m_i| (a first-order term predicts the sign
   of a negligible change well too: this rate says which edges matter), and the size of the change
   (|Δm_i| / |m_i|, medians). The ablation is the whole model's answer: attention
   paths and the blocks between move too, which the term leaves out.
2. Cost: the live worker's app in this process (no sockets), the 32-token prompt of bench.live_trace, its
   last position and prediction: POST /trace (the live view's trace) and POST /circuit, interleaved; p50 /
   p95 of each and the ratio of the p50s (target ≤ 1.5). The same for the engine functions alone.
Figures go into bench-results.json under "circuit".
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from fastapi.testclient import TestClient

from bench import harness
from bench.live_trace import prompt
from ffmem.config import get_settings
from ffmem.engine.allocator import keep_freed_memory
from ffmem.engine.live.circuit import circuit, read_vectors_here
from ffmem.engine.live.edited_forward import intervene
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.trace import trace
from ffmem.engine.mining.corpus import read_corpus
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loading import shared_model
from ffmem.engine.relations.weight_graph import value_vectors
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

ROUNDS = 30
TARGET_RATIO = 1.5
MEANINGFUL = 0.01  # a change of m_i of at least 1 % of |m_i|


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def sentences(loaded, n: int) -> list[list[int]]:
    """The first `n` corpus sentences of 12–40 tokens, as token ids."""
    found = []
    for sentence in read_corpus("wiki-vital", 500).sentences:
        ids = loaded.tokenizer(sentence).input_ids
        if 12 <= len(ids) <= 40:
            found.append(ids)
        if len(found) == n:
            return found
    raise SystemExit(f"fewer than {n} sentences of 12–40 tokens in the corpus")


def coefficients(loaded, ids: list[int], edits=()) -> tuple[torch.Tensor, torch.Tensor]:
    """m [layers, d_ff] and the FF inputs r [layers, d] at the last position, with `edits`."""
    with (
        torch.inference_mode(),
        intervene(loaded, edits),
        capture(loaded.model, loaded.adapter, fields=("coefficients", "residual")) as c,
    ):
        loaded.model.base_model(input_ids=torch.tensor([ids]), use_cache=False)
        layers = sorted(c.coefficients)
        m = torch.stack([c.coefficients[layer][0, -1].float() for layer in layers])
        r = torch.stack([c.residual[layer][0, -1] for layer in layers])
    return m, r


def validate(loaded, prompts: list[list[int]], edges_per_prompt: int, seed: int) -> dict:
    rng = random.Random(seed)
    values = [value_vectors(loaded, layer) for layer in range(loaded.n_layers)]  # [d_ff, d] each
    outcomes = {"circuit": [], "random": []}  # (agrees, |Δm_i| / |m_i|)
    edges_found = []
    for ids in prompts:
        found = circuit(loaded, ids)
        edges_found.append(len(found.edges))
        m, r = coefficients(loaded, ids)
        for edge in rng.sample(found.edges, min(edges_per_prompt, len(found.edges))):
            i_layer, i = edge.downstream.layer, edge.downstream.key
            j_layer, j_random = edge.upstream.layer, rng.randrange(loaded.n_keys)
            with torch.inference_mode():
                read = read_vectors_here(loaded, i_layer, torch.tensor([i]), r[i_layer])[0]  # [d]
                random_term = float(m[j_layer, j_random] * (values[j_layer][j_random] @ read))
            pairs = {
                "circuit": (edge.upstream.layer, edge.upstream.key, edge.term),
                "random": (j_layer, j_random, random_term),
            }
            m_i = float(m[i_layer, i])
            for name, (j_layer, j, term) in pairs.items():
                edited, _ = coefficients(loaded, ids, [Intervention(j_layer, j, "off")])
                delta = float(edited[i_layer, i]) - m_i
                outcomes[name].append((_sign(delta) == -_sign(term) != 0, abs(delta) / max(abs(m_i), 1e-9)))
    summary = {}
    for name, found in outcomes.items():
        summary[name] = {
            "edges": len(found),
            "direction_agrees": round(sum(a for a, _ in found) / max(1, len(found)), 4),
            "agrees_by_1pct": round(sum(a and r >= MEANINGFUL for a, r in found) / max(1, len(found)), 4),
            "median_relative_change": round(statistics.median(r for _, r in found), 5) if found else None,
        }
    summary["edges_per_circuit"] = edges_found
    return summary


def timing(loaded, text: str, ids: list[int]) -> dict:
    """The live worker's /trace and /circuit for one position (the last) and target (the prediction), and
    the engine's trace and circuit, interleaved after 3 warm-up rounds."""
    live = Live(device="cpu", max_tokens=512)
    live.models[loaded.source] = loaded
    worker = TestClient(create_live_app(live), base_url="http://worker")
    request = {"model": loaded.source, "text": text}

    def answered(path: str):
        def run() -> None:
            answer = worker.post(path, json=request)
            assert answer.status_code == 200, answer.text

        return run

    variants = {
        "server_trace": answered("/trace"),
        "server_circuit": answered("/circuit"),
        "engine_trace": lambda: trace(loaded, ids),
        "engine_circuit": lambda: circuit(loaded, ids),
    }
    times = harness.interleaved(variants, ROUNDS)
    shown = {name: harness.percentiles(samples) for name, samples in times.items()}
    for where in ("server", "engine"):
        shown[f"{where}_ratio_p50"] = round(
            shown[f"{where}_circuit"]["p50_ms"] / shown[f"{where}_trace"]["p50_ms"], 3
        )
    paired = zip(times["server_circuit"], times["server_trace"], strict=True)
    shown["paired_median_ratio_server"] = round(statistics.median(c / t for c, t in paired), 3)
    return shown


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="corpus sentences validated")
    parser.add_argument("--edges", type=int, default=10, help="edges sampled per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kept = keep_freed_memory()  # as `ffmem worker` does
    settings = get_settings()
    loaded = shared_model(settings.model, device="cpu", cache_dir=settings.cache_dir)
    start = time.perf_counter()
    validation = validate(loaded, sentences(loaded, args.prompts), args.edges, args.seed)
    seconds = round(time.perf_counter() - start, 1)
    validation |= {"prompts": args.prompts, "seed": args.seed, "seconds": seconds}
    print(validation, flush=True)
    text, ids = prompt(loaded)
    costs = timing(loaded, text, ids) | {
        "prompt_tokens": len(ids),
        "target_ratio": TARGET_RATIO,
        "threads": torch.get_num_threads(),
        "freed_memory_kept": kept,
        "device": "cpu",
    }
    print(costs, flush=True)
    harness.record(args, "circuit", {"validation": validation, "cost": costs})


if __name__ == "__main__":
    main()
