"""`ffmem trace`: trace a prompt in a terminal and print the prompt's tokens, per layer top(r), top(y),
top(o), the final token under r, the case and the memories, the top tokens (with and without edits), then
who pushes the target token, as Rich tables. The explorer's trace page shows the same result
(ffmem/web/pages/trace.py).
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ffmem.cli.common import Device, fail_cleanly
from ffmem.config import get_settings
from ffmem.engine.errors import FfmemError
from ffmem.engine.values.token_display import visible

if TYPE_CHECKING:
    from ffmem.engine.live.trace import Trace


class Readout(str, Enum):
    norm = "norm"
    raw = "raw"


def trace_command(
    text: Annotated[str, typer.Argument(help="The prompt.")],
    model: Annotated[str | None, typer.Option(help="Model (default: settings.model).")] = None,
    position: Annotated[int | None, typer.Option(min=0, help="Token position (default: the last).")] = None,
    memories: Annotated[int, typer.Option(min=1, max=100, help="Memories listed per layer.")] = 3,
    readout: Annotated[
        Readout, typer.Option(help="norm: the model's final norm + unembedding; raw: r·E.")
    ] = (Readout.norm),
    intervene: Annotated[
        str, typer.Option(help="Memories to edit: L12K345 (off), L12K345*0.5 (scale), L12K345=3.2 (on).")
    ] = "",
    generate: Annotated[int, typer.Option(min=0, max=20, help="Greedy tokens, with and without edits.")] = 0,
    target: Annotated[
        str | None,
        typer.Option(help="Who pushes this token (' London' or #5188; default: the prediction)."),
    ] = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
) -> None:
    """Trace a prompt: per layer top(r), top(y), top(o), the final token under r, the case, the memories;
    then who pushes the target token: per layer the memories' contributions m_i·(v_i·e_t) and their sum
    beside the FF's change to its logit."""
    settings = get_settings()

    def run():
        from ffmem.engine.live.attribution_terms import target_tokens
        from ffmem.engine.live.interventions import parse_interventions
        from ffmem.engine.live.trace import trace
        from ffmem.engine.model.loading import load_model

        loaded = load_model(model or settings.model, device=device.value, cache_dir=settings.cache_dir)
        ids = loaded.tokenizer(text).input_ids
        if not text.strip() or not ids:
            raise FfmemError("the prompt is empty")
        if len(ids) > settings.max_prompt_tokens:
            raise FfmemError(f"the prompt has {len(ids)} tokens; the limit is {settings.max_prompt_tokens}")
        if position is not None and position >= len(ids):
            raise FfmemError(f"position {position} is past the prompt's {len(ids)} tokens (0–{len(ids) - 1})")
        edits = parse_interventions(intervene, loaded.n_layers, loaded.n_keys)
        typed = target_tokens(loaded.tokenizer, loaded.model.config.vocab_size, target)
        result = trace(
            loaded,
            ids,
            position,
            memories=memories,
            readout=readout.value,
            interventions=edits,
            generate_tokens=generate,
            value_tokens=3,
            target=typed[0] if typed else None,
        )
        return loaded, result

    loaded, result = fail_cleanly(run)
    print_trace(result, loaded.tokenizer)


def print_trace(result: Trace, tokenizer) -> None:
    """Print a trace's result (ffmem.engine.live.trace.trace), its tokens decoded with `tokenizer`."""

    def tok(token_id: int) -> str:
        return visible(tokenizer.decode([token_id]))

    console = Console(highlight=False)
    chips = " ".join(
        f"[{'reverse' if i == result.position else 'dim'}]{i}:{tok(t)}[/]"
        for i, t in enumerate(result.token_ids)
    )
    console.print(chips)
    edited = f", with the edits (without them: {tok(result.unedited.prediction)})" if result.unedited else ""
    console.print(
        f"prediction after position {result.position}: [bold]{tok(result.prediction)}[/] "
        f"({result.readout} readout){edited}"
    )
    table = Table(
        "layer",
        "top(r)",
        "top(y)",
        "top(o)",
        "p(final|r)",
        "rank",
        "case",
        "memories (m: value tokens)",
        title="with the edits" if result.unedited else None,
    )
    for layer in result.layers:
        listed = "; ".join(
            f"K{m.key} {m.coefficient:+.2f}: {' '.join(tok(t) for t in m.tokens)}" for m in layer.memories
        )
        case = layer.case + (" ✓" if layer.settled else "")
        table.add_row(
            str(layer.layer),
            tok(layer.top_r),
            tok(layer.top_y),
            tok(layer.top_o),
            f"{layer.final_prob:.3f}",
            str(layer.final_rank),
            case,
            listed,
        )
    console.print(table)
    shown = Table("token", "p", *(["p edited", "change"] if result.interventions else []), title="top tokens")
    for change in result.top_tokens:
        extra = (
            [f"{change.after:.3f}", f"{change.after - change.before:+.3f}"] if result.interventions else []
        )
        shown.add_row(tok(change.token_id), f"{change.before:.3f}", *extra)
    console.print(shown)
    if result.generated:
        console.print(f"greedy: {visible(tokenizer.decode(result.generated))}")
    if result.generated_edited:
        console.print(f"greedy, edited: {visible(tokenizer.decode(result.generated_edited))}")
    _print_attribution(console, result.attribution, tok)


def _print_attribution(console, attribution, tok) -> None:
    """Who pushes the target token: per layer Σ m_i·(v_i·e_t) beside the FF's change to its logit."""
    table = Table(
        "layer",
        "Σ memories",
        "FF change",
        "difference",
        "largest contributions (c = m·v·e_t)",
        title=f"who pushes {tok(attribution.target)} ({attribution.readout} readout, logit "
        f"{attribution.logit:.2f}; Σ over all memories {attribution.total:+.2f})",
    )
    for layer in attribution.layers:
        listed = "; ".join(f"K{c.key} {c.contribution:+.3f}" for c in layer.memories)
        table.add_row(
            str(layer.layer),
            f"{layer.memories_sum:+.3f}",
            f"{layer.change:+.3f}",
            f"{layer.residual:+.3f}",
            listed,
        )
    console.print(table)
    for name, listed in (("promoters", attribution.promoters), ("suppressors", attribution.suppressors)):
        console.print(f"{name}: " + ", ".join(f"L{c.layer}K{c.key} {c.contribution:+.3f}" for c in listed))
