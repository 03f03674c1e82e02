"""A gated memory's sign quadrants (GLUScope's view of a SwiGLU neuron): its coefficient m = act(x·g)·(x·u)
has a gate act(x·g) and an input x·u, and each pair of their signs is a different way to make m — the key
page's 2×2 panel (the share of mined positions in each) and one page per quadrant with its top examples."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import corpora
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import Quadrants, RunResults, results_for
from ffmem.web import urls
from ffmem.web.errors import AppError
from ffmem.web.views import ModelPage, Provisional, RunInfo, run_info

QUADRANTS = ("pp", "pn", "np", "nn")  # mined_layer.QUADRANTS: the gate's sign first (p: ≥ 0, n: < 0)


class QuadrantShare(BaseModel):
    """One sign quadrant of a gated memory."""

    quadrant: str = Field(description="pp, pn, np or nn: the gate's sign, then the input's (p: ≥ 0, n: < 0).")
    gate: int = Field(description="+1: the gate act(x·g) ≥ 0; −1: < 0.")
    input: int = Field(description="+1: the input x·u ≥ 0; −1: < 0.")
    sign: int = Field(description="The coefficient's sign there: the product of the two.")
    share: float = Field(description="The share of mined positions in this quadrant.")
    examples: int = Field(description="Its top examples kept (by |m|).")
    url: str = Field(description="Its examples' page.")


class QuadrantPanel(BaseModel):
    """The key page's 2×2 panel: the four quadrants (pp, pn, np, nn) and the one most positions are in."""

    quadrants: list[QuadrantShare]
    dominant: str


class QuadrantExample(BaseModel):
    """A sentence among a quadrant's top examples: its largest |m| among the quadrant's positions."""

    sentence_index: int
    position: int = Field(description="The token where it is, 0-based.")
    coefficient: float = Field(description="m = gate · input there.")
    gate: float | None = Field(description="act(x·g) = m / input (null where the input is 0).")
    input: float = Field(description="x·u, the input (up) projection.")
    prefix: str = Field(description="The sentence up to the token, without it.")
    token: str = Field(description="The token.")
    rest: str = Field(description="The sentence after it.")


class QuadrantContext(ModelPage):
    """One quadrant of a gated memory: its top examples."""

    page: str = "quadrant"
    layer: int
    key: int
    run: RunInfo
    quadrant: QuadrantShare
    quadrants: list[QuadrantShare] = Field(description="All four, this one among them.")
    examples: list[QuadrantExample] = Field(description="Strongest |m| first.")
    key_url: str
    provisional: Provisional = None


def quadrant_panel(results: RunResults, slug: str, run: Run, layer: int, key: int) -> QuadrantPanel | None:
    """The key page's panel; None for an ungated model or a run stored before quadrants."""
    found = results.quadrants(layer, key)
    if found is None:
        return None
    shares = _shares(found, slug, run, layer, key)
    return QuadrantPanel(quadrants=shares, dominant=max(shares, key=lambda s: s.share).quadrant)


def quadrant_page(
    session: Session, model: LanguageModel, run: Run, layer: int, key: int, quadrant: str
) -> QuadrantContext:
    results = results_for(session, run)
    found = results.quadrants(layer, key)
    if found is None:
        detail = (
            f"{model.slug}'s feed-forward layers have no gate, so its memories have no sign quadrants."
            if not model.gated
            else "This run was indexed before sign quadrants were mined: index the model again to see them."
        )
        raise AppError(404, "No quadrants", detail, link=(urls.key_url(model.slug, layer, key), "the key"))
    shares = _shares(found, model.slug, run, layer, key)
    number = QUADRANTS.index(quadrant)
    chosen = [e for e in found.examples if e.quadrant == number]
    sentences = corpora.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[e.sentence_index for e in chosen]
    )
    examples = []
    for example in chosen:
        sentence = sentences[example.sentence_index]
        start, end = sentence.offsets[example.position]
        examples.append(
            QuadrantExample(
                sentence_index=example.sentence_index,
                position=example.position,
                coefficient=example.coefficient,
                gate=example.gate,
                input=example.input,
                prefix=sentence.text[:start],
                token=sentence.text[start:end],
                rest=sentence.text[end:],
            )
        )
    return QuadrantContext(
        title=f"{model.slug}: layer {layer}, key {key}, quadrant {quadrant}",
        model=model.slug,
        layer=layer,
        key=key,
        run=run_info(run),
        quadrant=shares[number],
        quadrants=shares,
        examples=examples,
        key_url=urls.key_url(model.slug, layer, key, run=run.id),
        provisional=results.coverage(layer),
    )


def _shares(found: Quadrants, slug: str, run: Run, layer: int, key: int) -> list[QuadrantShare]:
    counts = [sum(e.quadrant == q for e in found.examples) for q in range(len(QUADRANTS))]
    return [
        QuadrantShare(
            quadrant=name,
            gate=-1 if name[0] == "n" else 1,
            input=-1 if name[1] == "n" else 1,
            sign=1 if name[0] == name[1] else -1,
            share=share,
            examples=count,
            url=urls.quadrant_url(slug, layer, key, name, run=run.id),
        )
        for name, share, count in zip(QUADRANTS, found.shares, counts, strict=True)
    ]
