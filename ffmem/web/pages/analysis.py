"""The analysis page: the paper's figures (Geva et al. 2021, §4–5) from a run's stored analyses, each
beside the paper's own values where it gives them (read off its plots: approximate; ../PAPER.md).
Depth is relative (layer / (layers − 1)) so the paper's 16 layers and any model's line up."""

from __future__ import annotations

import html
import math

from pydantic import BaseModel, Field

from ffmem.config import Settings
from ffmem.engine.paper.cases import CASES
from ffmem.store import analyses, jobs
from ffmem.store.db import Session
from ffmem.store.models import Analysis, LanguageModel, Run
from ffmem.store.specs import ANALYSIS_SIZES, AnalysisSpec
from ffmem.web.charts import BASE_LAYOUT
from ffmem.web.views import JobInfo, ModelPage, RunInfo, run_info

NAMES = ("agreement", "census", "token_removal")


class AnalysisFigure(BaseModel):
    """One of the paper's figures on this run: our per-layer series beside the paper's reference values."""

    name: str = Field(description="fig3, fig4, …")
    title: str
    text: str = Field(description="What the chart shows, in one paragraph.")
    unit: str = Field(description="share | count | probability | relative change | rank.")
    layers: list[int]
    depth: list[float] = Field(
        description="layer / (layers − 1): the paper's 16 layers and ours on one axis."
    )
    series: dict[str, list[float | None]] = Field(description="Ours, by name: one value per layer.")
    paper: dict[str, list[list[float]]] = Field(
        description="The paper's values as [relative depth, value] points (approximate)."
    )


class AnalysisContext(ModelPage):
    """The paper's analyses (Figs. 3–11) on one index run."""

    page: str = "analysis"
    run: RunInfo
    computed: dict[str, dict] = Field(
        description="Analysis → {options, seconds, created_at, text: how it was computed, in words}."
    )
    missing: list[str] = Field(description="Analyses not computed on this run yet.")
    figures: list[AnalysisFigure]
    jobs: list[JobInfo] = Field(description="The run's analysis jobs, the newest first.")
    defaults: dict = Field(
        description="The options the form offers a new analysis job: the settings', each no more than the "
        "run holds (held-out sentences, keys a layer, top triggers a key)."
    )
    command: str = Field(description="The command that computes them with those options.")


def _paper(*points: tuple[float, float]) -> list[list[float]]:
    return [[x, y] for x, y in points]


def analysis_page(session: Session, settings: Settings, model: LanguageModel, run: Run) -> AnalysisContext:
    stored = analyses.stored_analyses(session=session, run_id=run.id)
    layers = list(range(model.n_layers))
    depth = [layer / max(1, model.n_layers - 1) for layer in layers]

    def figure(name, title, text, unit, series, paper=None) -> AnalysisFigure:
        return AnalysisFigure(
            name=name,
            title=title,
            text=text,
            unit=unit,
            layers=layers,
            depth=depth,
            series=series,
            paper=paper or {},
        )

    figures = []
    if (removal := stored.get("token_removal")) is not None:
        data = removal.data
        figures.append(
            figure(
                "fig3",
                "Fig. 3 — removing the first or the last token of a trigger prefix",
                f"For {removal.options['keys']} sampled keys a layer and their top "
                f"{removal.options['triggers']} trigger prefixes ({data['prefixes']:,} prefixes): the mean "
                f"relative change of the key's coefficient when the prefix loses its first token, and when "
                f"it loses its last. The paper found the last token matters most, less so with depth (about "
                f"−70% in layer 1 to −20% in layer 16), and the first hardly at all: lower layers' keys are "
                f"shallow (n-gram) patterns, upper ones semantic.",
                "relative change",
                {"first token removed": data["first"], "last token removed": data["last"]},
                {"last token removed (paper)": _paper((0, -0.7), (1, -0.2))},
            )
        )
    if (agreement := stored.get("agreement")) is not None:
        data = agreement.data
        figures.append(
            figure(
                "fig4",
                "Fig. 4 — agreement rate: keys whose value predicts what follows their top trigger",
                f"The share of keys whose value's top token (raw readout, softmax(v·E)) is the token that "
                f"follows their top trigger prefix; a random value would agree {data['baseline']:.2g} of the "
                f"time. The paper saw almost none in layers 1–10 and up to about 3.5% in the upper layers: "
                f"upper-layer values predict what follows their keys' patterns.",
                "share",
                {"agreement rate": data["agreement"], "random baseline": [data["baseline"]] * len(layers)},
                {"agreement rate (paper)": _paper((0, 0.0), (0.6, 0.0), (1, 0.035))},
            )
        )
        figures.append(
            figure(
                "fig5",
                "Fig. 5 — rank of the next token in the value's distribution",
                "Quartiles of the rank (0 = top) of the token after each key's top trigger among its "
                "value's logits. The paper found the rank falls in the upper layers.",
                "rank",
                {
                    f"q{float(q):.2f}": values
                    for q, values in data["rank_quantiles"].items()
                    if q in ("0.25", "0.5", "0.75")
                },
            )
        )
    if (found := stored.get("census")) is not None:
        data, n_keys = found.data, model.n_keys
        figures += [
            figure(
                "fig7",
                "Fig. 7 — active memories",
                f"Over {data['examples']:,} held-out prefixes (sentences the run did not mine, one random "
                f"position each): the share of a layer's {n_keys:,} memories with m > 0, and with a "
                f"non-negligible coefficient (|m| within 3 octaves of the strongest; gated and GELU memories "
                f"are never exactly off). The paper (ReLU) saw 10%–50% active, with a dip near layer 10.",
                "share",
                {
                    "m > 0": [v / n_keys for v in data["positive"]],
                    "non-negligible": [v / n_keys for v in data["active"]],
                },
                {"paper: low end": _paper((0, 0.1), (1, 0.1)), "paper: high end": _paper((0, 0.5), (1, 0.5))},
            ),
            figure(
                "fig8",
                "Fig. 8 — the FF output is a composition",
                "The share of examples whose FF output's top token is the value top token of none of the "
                "active memories (each read in its coefficient's direction); and, of the others, the share "
                "where that token is a stop word. The paper: at least ~68% in every layer; 60% stop words.",
                "share",
                {
                    "no single memory": data["no_memory_agrees"],
                    "stop words when one agrees": data["stop_words"],
                },
                {"no single memory (paper, ≥)": _paper((0, 0.68), (1, 0.68))},
            ),
            figure(
                "fig9",
                "Fig. 9 — the residual already predicts the output",
                "The share of examples whose residual top token (before the FF, read through the final norm "
                "and the unembedding) already is the model's final prediction. The paper: about a third in "
                "the bottom layers, rising fast from layer 10.",
                "share",
                {"top(r) = final": data["settled"]},
                {"paper (approx.)": _paper((0, 0.33), (0.6, 0.4), (1, 0.9))},
            ),
            figure(
                "fig10",
                "Fig. 10 — the residual's confidence in the final token",
                "The mean probability of the model's final prediction under the residual, per layer: the "
                "residual refines toward the prediction with depth.",
                "probability",
                {"p(final | r)": data["final_prob"]},
            ),
            figure(
                "fig11",
                "Fig. 11 — how each layer's output relates to the residual and the FF",
                "Per layer, the share of examples where the layer output's top token is that of the "
                "residual (residual), of the FF (ffn), of both (agreement) or of neither (composition). The "
                "paper: the residual dominates; when the layer changes the prediction it is mostly a "
                "composition, the FF vetoing the residual's choice.",
                "share",
                {case: data["cases"][case] for case in CASES},
            ),
        ]
    defaults = fitted_defaults(settings, model, run)
    return AnalysisContext(
        title=f"{model.slug}: the paper's analyses",
        model=model.slug,
        run=run_info(run),
        computed={
            name: {
                "options": a.options,
                "seconds": a.seconds,
                "created_at": a.created_at.isoformat(),
                "text": computed_text(name, a),
            }
            for name, a in stored.items()
        },
        missing=[name for name in NAMES if name not in stored],
        figures=figures,
        jobs=[
            JobInfo.model_validate(job, from_attributes=True)
            for job in jobs.analysis_jobs(session=session, run_id=run.id)
        ],
        defaults=defaults,
        command=f"ffmem analyze --run {run.id} " + " ".join(f"--{n} {defaults[n]}" for n in ANALYSIS_SIZES),
    )


def fitted_defaults(settings: Settings, model: LanguageModel, run: Run) -> dict:
    """The settings' analysis options, each cut to what the run holds: its held-out sentences (the
    examples; a run holding none reads the source's sentences after its corpus, so the setting stays), the
    model's keys a layer and the run's top-T triggers a key."""
    spec = AnalysisSpec.from_settings(settings)
    held = held_out_count(run)
    return spec.model_copy(
        update={
            "examples": min(spec.examples, held) if held else spec.examples,
            "keys": min(spec.keys, model.n_keys),
            "triggers": min(spec.triggers, run.top_k),
        }
    ).model_dump()


def held_out_count(run: Run) -> int:
    """How many sentences the run held out of mining: every `held_out_every`-th of its corpus
    (ffmem.engine.mining.corpus.held_out_sentences, counted without torch)."""
    every = (run.provenance or {}).get("held_out_every", 0)
    return run.corpus.n_sentences // every if every else 0


def computed_text(name: str, analysis: Analysis) -> str:
    """How a stored analysis was computed, as a sentence (its options are what it recorded)."""
    options = analysis.options
    read = {
        "agreement": "Agreement (Figs. 4–5): read off the index, each key's top trigger and its value",
        "census": f"Census (Figs. 7–11): over {options.get('examples', 0):,} held-out prefixes, one random "
        f"position of each held-out sentence (seed {options.get('seed', 0)})",
        "token_removal": f"Token removal (Fig. 3): {options.get('keys', 0):,} sampled keys a layer and their "
        f"top {options.get('triggers', 0):,} trigger prefixes (seed {options.get('seed', 0)})",
        "token_change": f"TokenChange: {options.get('memories', 0):,} memories sampled across the layers, "
        f"each over its top {options.get('contexts', 0):,} held-out contexts (seed {options.get('seed', 0)})",
    }.get(name, name.replace("_", " ").capitalize())
    when = analysis.created_at.strftime("%Y-%m-%d %H:%M")
    return f"{read}; computed in {analysis.seconds:.1f} s on {when} UTC."


SERIES_COLORS = ("#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b7791f")


def log_ticks(low: float, high: float) -> list[int]:
    """1, 2 and 5 times the powers of ten from below `low` to above `high`."""
    ticks, power = [], 1
    while power <= 10 * high:
        ticks += [step * power for step in (1, 2, 5)]
        power *= 10
    below = max([tick for tick in ticks if tick <= low], default=1)
    above = min([tick for tick in ticks if tick >= high], default=ticks[-1])
    return [tick for tick in ticks if below <= tick <= above]


PAPER_LINE = {"color": "rgba(113, 128, 150, 0.55)", "width": 5, "dash": "dash"}
PAPER_BAND = "rgba(113, 128, 150, 0.15)"


def analysis_chart(figure: AnalysisFigure) -> dict:
    """Our per-layer series (solid, by relative depth) and the paper's values (dashed, approximate).

    The paper's lines are drawn first, wide and translucent, so where ours runs on top of one both stay
    visible; a paper range (a "low end" and a "high end", Fig. 7) is a shaded band between them."""
    paper = []
    for name, points in figure.paper.items():
        band = name.endswith("high end") and paper and paper[-1]["name"].endswith("low end")
        paper.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": html.escape(name, quote=False),
                "x": [x for x, _ in points],
                "y": [y for _, y in points],
                "line": PAPER_LINE,
                **({"fill": "tonexty", "fillcolor": PAPER_BAND} if band else {}),
                "hovertemplate": "paper: %{y:.3g}<extra></extra>",
            }
        )
    data = paper + [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": html.escape(name, quote=False),
            "x": figure.depth,
            "y": values,
            "customdata": figure.layers,
            "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)]},
            "hovertemplate": "layer %{customdata}<br>%{y:.3g}<extra>"
            + html.escape(name, quote=False)
            + "</extra>",
        }
        for i, (name, values) in enumerate(figure.series.items())
    ]
    if figure.unit == "rank":  # log scale, every tick written out in full: 1, 2, 5, 10, 20, …, 20,000
        ranks = [v for values in figure.series.values() for v in values if v is not None and v > 0]
        ticks = log_ticks(min(ranks, default=1), max(ranks, default=10))
        yaxis = {"title": {"text": "rank (0 = top; log scale)"}, "type": "log"}
        yaxis |= {"tickvals": ticks, "ticktext": [f"{tick:,}" for tick in ticks]}
        yaxis["range"] = [math.log10(ticks[0]), math.log10(ticks[-1])]  # from the tick below to the one above
    elif figure.unit in ("share", "probability"):
        yaxis = {"title": {"text": figure.unit}, "rangemode": "tozero"}
        if figure.unit == "share":
            yaxis["tickformat"] = ".0%"
    else:
        yaxis = {"title": {"text": figure.unit}}
    return {
        "data": data,
        "layout": BASE_LAYOUT
        | {
            "title": {"text": ""},  # the page heads the chart with its title (it wraps there)
            "margin": {"l": 60, "r": 20, "t": 16, "b": 48},
            "showlegend": True,
            "legend": {"orientation": "h", "y": -0.3},
            "height": 360,
            "xaxis": {"title": {"text": "relative depth (layer / last layer)"}, "range": [-0.02, 1.02]},
            "yaxis": yaxis,
        },
    }
