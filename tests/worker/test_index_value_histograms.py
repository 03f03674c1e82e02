"""An index run stores one value histogram row per memory, in its prepare stage: both readouts, each the
projection's own histogram of that value (the tiny model's index, on SQLite and Postgres)."""

from __future__ import annotations

import numpy as np
from sqlalchemy import func, select

from ffmem.engine.values.projection import HISTOGRAM_BINS, project_layer
from ffmem.store import value_histograms
from ffmem.store.memory_lists import READOUTS
from ffmem.store.models import ValueHistogram


def test_an_index_run_stores_every_values_histogram(db, run, tiny):
    rows = db.execute(
        select(ValueHistogram.layer, func.count())
        .where(ValueHistogram.run_id == run.id)
        .group_by(ValueHistogram.layer)
    ).all()
    assert sorted(rows) == [(layer, tiny.n_keys) for layer in range(tiny.n_layers)]
    vocab = tiny.model.config.vocab_size
    for layer in range(tiny.n_layers):
        projected = {p.readout: p.histogram for p in project_layer(tiny, layer, n=1) if p.direction == 1}
        for key in range(tiny.n_keys):
            stored = value_histograms.value_histogram(session=db, run_id=run.id, layer=layer, key=key)
            assert set(stored) == set(READOUTS)
            for readout, histogram in stored.items():
                expected = projected[readout]
                assert histogram.counts == expected.counts[key].tolist()
                assert len(histogram.counts) == HISTOGRAM_BINS and sum(histogram.counts) == vocab
                assert (histogram.low, histogram.high) == (
                    float(expected.low[key]),
                    float(expected.high[key]),
                )
                assert np.isclose(histogram.edges[-1], histogram.high) and histogram.edges[0] == histogram.low
