"""Speed and memory of the index path, as ratios measured in one run (the first of `make bench`).

- mining throughput over a bare forward pass of the same backbone on the same batches (target ≥ 0.95)
- padding efficiency of the length-bucketed batches of the default index (target ≥ 0.90)
- projection time of every value (all layers, both readouts)
- the projection and the next-token ranks as shares of their bare bf16 products (target ≥ 0.5)
- peak memory of mining two corpus sizes, each in a fresh process (should not grow with the corpus)
Prints the figures and writes them to bench-results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import torch

from bench import harness
from ffmem.config import get_settings
from ffmem.engine.mining.batches import corpus_batches, mine_batches
from ffmem.engine.mining.corpus import mined_from, read_corpus, tokenize
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loading import load_model
from ffmem.engine.values.projection import READOUTS, project_layer, target_ranks
from ffmem.engine.values.token_memories import TokenMemories


def batches_for(loaded, n_sentences: int, settings):
    return batches_of(loaded, read_corpus("wiki-vital", n_sentences).sentences, settings)


def batches_of(loaded, sentences: list[str], settings) -> list:
    """The index's batches of these sentences: tokenized, mined from where a run mines them, in its
    shards and token budget."""
    tokenized = tokenize(sentences, loaded.tokenizer, settings.max_sentence_tokens)
    return corpus_batches(
        [s.token_ids for s in tokenized],
        mined_from([s.first_position for s in tokenized], first_position=settings.first_position),
        shard_sentences=settings.shard_sentences,
        memories=loaded.n_layers * loaded.n_keys,
        batch_tokens=settings.batch_tokens,
        pad_id=loaded.tokenizer.eos_token_id or 0,
    )


def mining_over_forward(loaded, batches, repeats: int) -> dict:
    """Best-of-`repeats` seconds for bare forwards and for mining, interleaved on the same batches.

    Mining runs the backbone only (no unembedding: it needs no logits). The like-for-like ratio
    divides by a bare forward of that same backbone; the model ratio by the model's full forward.
    """
    tokens = sum(b.real_tokens for b in batches)
    bare, full, mining = [], [], []
    for _ in range(repeats):
        for module, times in ((loaded.model.base_model, bare), (loaded.model, full)):
            start = time.perf_counter()
            with torch.inference_mode():
                for batch in batches:
                    module(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            times.append(time.perf_counter() - start)
        gated = loaded.adapter.gates is not None  # with the sign quadrants, as `ffmem index` mines
        state = MiningState(
            loaded.n_layers, loaded.n_keys, get_settings().top_k, device=loaded.device, gated=gated
        )
        start = time.perf_counter()
        mine_batches(loaded, batches, state)
        mining.append(time.perf_counter() - start)
    return {
        "tokens": tokens,
        "bare_backbone_forward_tokens_per_s": tokens / min(bare),
        "bare_model_forward_tokens_per_s": tokens / min(full),
        "mining_tokens_per_s": tokens / min(mining),
        "mining_over_backbone_forward": min(bare) / min(mining),
        "mining_over_model_forward": min(full) / min(mining),
        "target": 0.95,
    }


def projection_seconds(loaded) -> float:
    start = time.perf_counter()
    for layer in range(loaded.n_layers):
        for _ in project_layer(loaded, layer, get_settings().value_tokens):
            pass
    return time.perf_counter() - start


def projection_over_matmul(loaded, chunk: int = 512) -> dict:
    """The value projection (both readouts, with the token → memories table, as an index builds it) and the
    next-token ranks (raw readout), each as a share of the bare bf16 matrix products they contain, timed
    in this run on this CPU: 1.0 would be stages as fast as their products alone (issue 41 asks ≥ 0.5).
    GFLOP/s count the products' 2·keys·vocab·d flops."""
    settings = get_settings()
    weight = resolve(loaded.model, loaded.adapter.unembedding).weight  # [vocab, d]
    vocab, d = weight.shape
    keys = loaded.n_layers * loaded.n_keys
    flops = 2 * keys * vocab * d  # one readout
    weight_bf16 = weight.detach().bfloat16()  # [vocab, d]
    product = torch.empty(chunk, vocab, dtype=torch.bfloat16)  # [chunk, vocab]
    read = torch.randn(chunk, d).bfloat16()  # [chunk, d]
    start = time.perf_counter()
    for _ in range(0, keys, chunk):
        torch.matmul(read, weight_bf16.T, out=product)
    matmul = time.perf_counter() - start  # one readout's products
    tables = {r: TokenMemories.of(loaded, settings.token_memories) for r in READOUTS}
    start = time.perf_counter()
    for layer in range(loaded.n_layers):
        for _ in project_layer(loaded, layer, settings.value_tokens, token_memories=tables):
            pass
    projection = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (loaded.n_keys,), generator=generator)  # [keys]
    start = time.perf_counter()
    for layer in range(loaded.n_layers):
        target_ranks(loaded, layer, targets)
    ranks = time.perf_counter() - start
    return {
        "bf16_matmul_gflops": flops / matmul / 1e9,
        "projection_seconds": projection,
        "projection_gflops": 2 * flops / projection / 1e9,
        "projection_over_matmul": 2 * matmul / projection,
        "target_ranks_seconds": ranks,
        "target_ranks_gflops": flops / ranks / 1e9,
        "target_ranks_over_matmul": matmul / ranks,
        "target": 0.5,
    }


def peak_memory_child(n_sentences: int) -> None:
    """Run in a fresh process: mine n sentences, print the process's peak RSS in MiB."""
    settings = get_settings()
    loaded = load_model(settings.model, device="cpu", dtype="float32", cache_dir=settings.cache_dir)
    batches = batches_for(loaded, n_sentences, settings)
    gated = loaded.adapter.gates is not None
    mine_batches(loaded, batches, MiningState(loaded.n_layers, loaded.n_keys, settings.top_k, gated=gated))
    print(
        json.dumps(
            {
                "sentences": n_sentences,
                "tokens": sum(b.real_tokens for b in batches),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def main() -> None:
    parser = harness.parser(__doc__, repeats=2)
    parser.add_argument("--sentences", type=int, default=1000, help="sentences for the throughput ratio")
    parser.add_argument("--memory-sizes", type=int, nargs=2, default=(200, 1000))
    parser.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_memory_child:
        peak_memory_child(args.peak_memory_child)
        return
    settings = get_settings()
    loaded = load_model(
        settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir
    )
    results: dict = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype),
            "threads": torch.get_num_threads(),
        },
        "model": loaded.slug,
    }

    default_batches = batches_for(loaded, settings.sentences, settings)
    real = sum(b.real_tokens for b in default_batches)
    results["padding_efficiency"] = {
        "sentences": settings.sentences,
        "batches": len(default_batches),
        "real_tokens": real,
        "computed_tokens": sum(b.computed_tokens for b in default_batches),
        "efficiency": real / sum(b.computed_tokens for b in default_batches),
        "target": 0.90,
    }
    print(f"padding efficiency (default index): {results['padding_efficiency']['efficiency']:.3f}")

    results["mining"] = mining_over_forward(
        loaded, batches_for(loaded, args.sentences, settings), args.repeats
    )
    m = results["mining"]
    print(
        f"mining {m['mining_tokens_per_s']:.0f} tok/s; over the bare backbone forward "
        f"({m['bare_backbone_forward_tokens_per_s']:.0f} tok/s) {m['mining_over_backbone_forward']:.3f}, "
        f"over the model's full forward ({m['bare_model_forward_tokens_per_s']:.0f} tok/s) "
        f"{m['mining_over_model_forward']:.3f}"
    )

    results["projection"] = {
        "seconds_all_values": projection_seconds(loaded),
        "values": loaded.n_layers * loaded.n_keys,
        "readouts": 2,
    }
    print(
        f"projection of all {loaded.n_layers * loaded.n_keys} values: "
        f"{results['projection']['seconds_all_values']:.1f} s"
    )

    results["projection_over_matmul"] = p = projection_over_matmul(loaded)
    print(
        f"bf16 products {p['bf16_matmul_gflops']:.0f} GFLOP/s; projection {p['projection_seconds']:.1f} s, "
        f"{p['projection_gflops']:.0f} GFLOP/s ({p['projection_over_matmul']:.2f} of the products); "
        f"target ranks {p['target_ranks_seconds']:.1f} s, {p['target_ranks_gflops']:.0f} GFLOP/s "
        f"({p['target_ranks_over_matmul']:.2f})"
    )

    peaks = []
    for n in args.memory_sizes:
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench", "--peak-memory-child", str(n)],
            capture_output=True,
            text=True,
            check=True,
            cwd=harness.ROOT,
        )
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1]))
    results["peak_memory"] = {"runs": peaks, "growth": peaks[1]["peak_rss_mib"] / peaks[0]["peak_rss_mib"]}
    print(
        "peak memory: " + ", ".join(f"{p['sentences']} sentences {p['peak_rss_mib']:.0f} MiB" for p in peaks)
    )

    harness.record(args, "index", results)


if __name__ == "__main__":
    main()
