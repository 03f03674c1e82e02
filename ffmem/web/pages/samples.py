"""A key's examples across the range (the key page loads them as a section): a few sentences from each band
of its coefficient histogram, each shaded by the key's coefficient once the run is stored."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import corpora, key_examples, vocabularies
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run, Sentence
from ffmem.store.results import results_for
from ffmem.web.pages.key import bin_labels
from ffmem.web.shading import key_scale, stored_shading
from ffmem.web.views import ModelPage, Provisional, RunInfo, ShadedText, run_info


class BandSample(BaseModel):
    """An example from one band of a key's coefficient range: a sentence whose extreme coefficient (its
    maximum when > 0, minimum when < 0) lies in histogram bin `bin` (`band`, its range), at `position`."""

    bin: int
    band: str = Field(description="The bin's range of m.")
    sign: int = Field(description="+1: the sentence's maximum m; −1: its minimum.")
    coefficient: float = Field(description="That extreme m.")
    sentence_index: int
    position: int = Field(description="The token where m is extreme, 0-based.")
    sentence: str
    shading: ShadedText | None = Field(
        None, description="m at every token; null while the run mines, or for runs stored before 0011."
    )


class SamplesContext(ModelPage):
    """A key's examples across the range (the key page loads them as a section)."""

    page: str = "samples"
    layer: int
    key: int
    run: RunInfo
    samples: list[BandSample] = Field(description="The strongest band first, positive then negative.")
    provisional: Provisional = None


def samples_page(session: Session, model: LanguageModel, run: Run, layer: int, key: int) -> SamplesContext:
    """A key's examples across the range: its band samples, each sentence shaded (once the run is stored)
    on the key page's scale."""
    results = results_for(session, run)
    samples = results.band_samples(layer, key)
    sentences = corpora.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[s.sentence_index for s in samples]
    )
    labels = bin_labels(run.histogram_edges)
    views = [_sample_view(s, sentences[s.sentence_index], labels) for s in samples]
    lengths = [len(sentences[s.sentence_index].token_ids) for s in samples]
    arrays = results.sample_shading(layer, key, lengths)
    if arrays is not None:
        wanted = {i for s in samples for i in sentences[s.sentence_index].token_ids}
        texts = vocabularies.token_texts(session=session, model_id=model.id, token_ids=wanted)
        scale = key_scale(results.triggers(layer, key, 1, 1), results.triggers(layer, key, -1, 1))
        for view, values in zip(views, arrays, strict=True):
            view.shading = stored_shading(sentences[view.sentence_index], values, view.position, texts, scale)
    return SamplesContext(
        title=f"{model.slug}: layer {layer}, key {key}, examples across the range",
        model=model.slug,
        layer=layer,
        key=key,
        run=run_info(run),
        samples=sorted(views, key=lambda v: (-v.sign, -abs(v.coefficient), v.sentence_index)),
        provisional=results.coverage(layer),
    )


def _sample_view(sample: key_examples.BandSample, sentence: Sentence, labels: list[str]) -> BandSample:
    """A band sample with its band's range (`labels`: bin_labels of the run's edges) and its sentence."""
    return BandSample(
        bin=sample.bin,
        band=labels[sample.bin],
        sign=1 if sample.coefficient > 0 else -1,
        coefficient=sample.coefficient,
        sentence_index=sample.sentence_index,
        position=sample.position,
        sentence=sentence.text,
    )
