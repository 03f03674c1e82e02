"""The sentences a run did not mine, on which the analyses and the explanations' scores are measured.

A run holds every `held_out_every`-th sentence of its corpus out of mining (its provenance says which:
ffmem.engine.mining.corpus.held_out_sentences), read back from the stored corpus. Sentences of the corpus's
source after those the run read (when it read fewer than the source holds: `--sentences`) were not mined
either: they follow, read again from the source — all there is for a run that held none out.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.engine.mining.corpus import TokenizedSentence, held_out_sentences, read_corpus, tokenize
from ffmem.engine.model.loaded import LoadedModel
from ffmem.store import corpora
from ffmem.store.models import Run


def held_out(session: Session, run: Run, wanted: int, loaded: LoadedModel) -> list[TokenizedSentence]:
    """At most `wanted` of the run's held-out sentences, tokenized: those it held out of mining, in corpus
    order, then — when they are fewer — the source's sentences after the ones the run read."""
    if wanted <= 0:
        return []
    corpus = run.corpus
    indices = held_out_sentences(corpus.n_sentences, run.provenance.get("held_out_every", 0))[:wanted]
    rows = corpora.get_sentences(session=session, corpus_id=corpus.id, indices=indices)
    found = [
        TokenizedSentence(row.text, row.token_ids, [tuple(o) for o in row.offsets], row.first_position)
        for row in (rows[i] for i in indices)
    ]
    if len(found) < wanted:
        found += _unread(corpus, wanted - len(found), loaded)
    return found


def _unread(corpus, wanted: int, loaded: LoadedModel) -> list[TokenizedSentence]:
    """The source's sentences after the corpus's (at most `wanted`), tokenized; none when it has no more
    or cannot be read again."""
    source = corpus.name if corpus.name == "wiki-vital" else corpus.source
    try:
        text = read_corpus(source, corpus.n_sentences + wanted)
    except (FfmemError, OSError):
        return []
    unseen = text.sentences[corpus.n_sentences :]
    with loaded.lock:  # the tokenizer is shared with live traces
        return tokenize(unseen, loaded.tokenizer, corpus.max_tokens) if unseen else []
