"""How much of the strongest-coefficient picture is position 0 (issue 13's first-position question).

For every key of every layer, over the default corpus's first N sentences as the index tokenizes them,
the largest and smallest coefficient at a sentence's first position and at every other position; then:
- the share of keys whose top (bottom) trigger, over all positions, sits at position 0;
- the share whose max |m| at position 0 exceeds its max |m| anywhere else, and the ratio's spread;
- how many of the model page's strongest keys (by max coefficient) owe it to position 0.
With --prefix-token ID, the same with that token put before every sentence (not mined): whether a
prefix the model was not trained with moves the spike off the sentence's first token.

    .venv/bin/python -m bench.first_position --sentences 2000
"""

from __future__ import annotations

import argparse
import json

import torch

from ffmem.engine.mining.corpus import read_corpus, tokenize
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loading import load_model


def extremes(loaded, token_ids: list[list[int]], first: int, batch_tokens: int = 4096):
    """Per layer, [keys] tensors: max and min of m at position `first` and at positions after it."""
    n_layers, n_keys = loaded.n_layers, loaded.n_keys
    inf = float("inf")
    out = {name: torch.full((n_layers, n_keys), v) for name, v in (("max0", -inf), ("min0", inf))}
    out |= {name: torch.full((n_layers, n_keys), v) for name, v in (("max1", -inf), ("min1", inf))}
    argmax0 = torch.zeros((n_layers, n_keys), dtype=torch.long)  # sentence of max0
    argmax1 = torch.zeros((n_layers, n_keys, 2), dtype=torch.long)  # sentence and position of max1
    order = sorted(range(len(token_ids)), key=lambda i: -len(token_ids[i]))
    pad = loaded.tokenizer.eos_token_id or 0
    state = {}

    def fold(layer: int, c: torch.Tensor) -> None:  # c: [batch, pos, keys]
        c = c.float()
        real = state["mask"][:, :, None]  # [batch, pos, 1]
        at0 = c[:, first, :]  # [batch, keys]
        rest = c[:, first + 1 :, :]
        mask = real[:, first + 1 :, :]
        lo = rest.masked_fill(~mask, inf).amin(dim=(0, 1)) if rest.shape[1] else None
        if rest.shape[1]:
            hi, where = rest.masked_fill(~mask, -inf).reshape(-1, n_keys).max(dim=0)  # [keys] each
            gain = hi > out["max1"][layer]
            at = torch.stack(
                [torch.tensor(state["rows"])[where // rest.shape[1]], where % rest.shape[1] + first + 1], -1
            )
            argmax1[layer] = torch.where(gain[:, None], at, argmax1[layer])
        else:
            hi = None
        best, row = at0.max(dim=0)
        better = best > out["max0"][layer]
        out["max0"][layer] = torch.where(better, best, out["max0"][layer])
        rows = torch.tensor(state["rows"])[row]
        argmax0[layer] = torch.where(better, rows, argmax0[layer])
        out["min0"][layer] = torch.minimum(out["min0"][layer], at0.amin(dim=0))
        if hi is not None:
            out["max1"][layer] = torch.maximum(out["max1"][layer], hi)
            out["min1"][layer] = torch.minimum(out["min1"][layer], lo)

    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, fields=("coefficients",), on_coefficients=fold),
    ):
        i = 0
        while i < len(order):
            width = len(token_ids[order[i]])
            members = order[i : i + max(1, batch_tokens // width)]
            i += len(members)
            ids = torch.full((len(members), width), pad)
            mask = torch.zeros((len(members), width), dtype=torch.bool)
            for r, m in enumerate(members):
                ids[r, : len(token_ids[m])] = torch.tensor(token_ids[m])
                mask[r, : len(token_ids[m])] = True
            state["mask"], state["rows"] = mask, members
            loaded.model.base_model(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    return out, argmax0, argmax1


def report(loaded, out, argmax0, argmax1, token_ids, first: int) -> dict:
    top0 = out["max0"] > out["max1"]  # [layers, keys]: the top trigger sits at position `first`
    bottom0 = out["min0"] < out["min1"]
    abs0 = torch.maximum(out["max0"], -out["min0"])
    abs1 = torch.maximum(out["max1"], -out["min1"])
    ratio = abs0 / abs1
    max_m = torch.maximum(out["max0"], out["max1"])  # the model page's max column
    flat = max_m.flatten().argsort(descending=True)
    n_keys = loaded.n_keys
    strongest = {}
    for n in (10, 100, 1000):
        strongest[f"top{n}_keys_by_max_at_first"] = int(top0.flatten()[flat[:n]].sum())
    examples = []
    for f in flat[:5].tolist():
        layer, key = divmod(f, n_keys)
        s = int(argmax0[layer, key])
        s1, p1 = argmax1[layer, key].tolist()
        examples.append(
            {
                "layer": layer,
                "key": key,
                "max_m": round(float(max_m[layer, key]), 1),
                "at_first": bool(top0[layer, key]),
                "max_m_elsewhere": round(float(out["max1"][layer, key]), 2),
                "first_token": loaded.tokenizer.decode(token_ids[s][first : first + 1]),
                "elsewhere_prefix_end": loaded.tokenizer.decode(token_ids[s1][max(first, p1 - 3) : p1 + 1]),
                "elsewhere_position": p1,
            }
        )
    per_layer = [round(float(top0[layer].float().mean()), 4) for layer in range(loaded.n_layers)]
    q = torch.tensor([0.5, 0.9, 0.99])
    return {
        "keys": top0.numel(),
        "top_trigger_at_first": round(float(top0.float().mean()), 4),
        "bottom_trigger_at_first": round(float(bottom0.float().mean()), 4),
        "max_abs_at_first_exceeds_elsewhere": round(float((abs0 > abs1).float().mean()), 4),
        "abs_ratio_first_over_elsewhere_quantiles_50_90_99": [
            round(float(x), 2) for x in ratio.flatten().quantile(q)
        ],
        "abs_ratio_max": round(float(ratio.max()), 1),
        "abs_ratio_median_where_first_wins": round(float(ratio[abs0 > abs1].median()), 2)
        if (abs0 > abs1).any()
        else None,
        "largest_max_m_at_first": round(float(out["max0"].max()), 1),
        "largest_max_m_elsewhere": round(float(out["max1"].max()), 1),
        **strongest,
        "top_trigger_at_first_per_layer": per_layer,
        "strongest_keys": examples,
    }


def sink_positions(
    loaded, token_ids: list[list[int]], keys: list[tuple[int, int]], ratio: float = 10.0
) -> dict:
    """Where the sink sits, sentence by sentence: the positions whose residual norm after each layer of
    `keys` is over `ratio` × the sentence's median, counted by position (0, 1, 2, later); and for each
    of `keys` the position of its largest coefficient in the sentences where that exceeds a tenth of
    its largest anywhere."""
    layers = sorted({layer for layer, _ in keys})
    sinks = {layer: {"0": 0, "1": 0, "2": 0, "later": 0, "none": 0} for layer in layers}
    peaks = {f"L{layer}K{key}": [] for layer, key in keys}  # (max m, position) per sentence
    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, layers, ("coefficients", "layer_output")) as c,
    ):
        for ids in token_ids:
            loaded.model.base_model(input_ids=torch.tensor([ids]), use_cache=False)
            for layer in layers:
                norms = c.layer_output[layer][0].float().norm(dim=-1)  # [pos]
                big = (norms > ratio * norms.median()).nonzero().flatten().tolist()
                for position in big:
                    sinks[layer][str(position) if position < 3 else "later"] += 1
                sinks[layer]["none"] += not big
            for layer, key in keys:
                m = c.coefficients[layer][0, :, key].float()  # [pos]
                peaks[f"L{layer}K{key}"].append((float(m.max()), int(m.argmax())))
    where = {}
    for name, rows in peaks.items():
        top = max(value for value, _ in rows)
        strong = [position for value, position in rows if value > top / 10]
        where[name] = {"largest": round(top, 1), "sentences_over_a_tenth": len(strong)}
        where[name] |= {f"at_{p}": sum(q == p for q in strong) for p in (0, 1, 2)}
        where[name]["later"] = sum(q > 2 for q in strong)
    return {"sink_ratio": ratio, "residual_norm_outliers_by_position": sinks, "strong_coefficients": where}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="wiki-vital")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--prefix-token", type=int, default=None, help="a token id put before every sentence")
    parser.add_argument(
        "--sinks",
        default=None,
        help="instead: where the sink sits, sentence by sentence, for these keys (e.g. 11:1229,28:678)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model, device="cpu", dtype="float32")
    tokenized = tokenize(read_corpus(args.corpus, args.sentences).sentences, loaded.tokenizer)
    first = 0 if args.prefix_token is None else 1
    token_ids = [([args.prefix_token] if first else []) + s.token_ids for s in tokenized]
    token_ids = [ids for ids in token_ids if len(ids) > first]
    if args.sinks:
        keys = [tuple(map(int, k.split(":"))) for k in args.sinks.split(",")]
        print(json.dumps({"sentences": len(token_ids), **sink_positions(loaded, token_ids, keys)}, indent=1))
        return
    out, argmax0, argmax1 = extremes(loaded, token_ids, first)
    result = {
        "model": args.model,
        "bos_prepended_by_tokenizer": loaded.bos_prepended,
        "bos_token": loaded.tokenizer.bos_token,
        "prefix_token": args.prefix_token,
        "sentences": len(token_ids),
        "one_token_sentences": sum(len(s.token_ids) == 1 for s in tokenized),
        **report(loaded, out, argmax0, argmax1, token_ids, first),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
