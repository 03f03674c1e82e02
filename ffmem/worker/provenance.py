"""What a run records of how it was made: its model (the model's row and vocabulary, `store_model`) and
its provenance (`provenance`: the model's and corpus's sources and hashes, the held-out and position
rules in words, the mining settings and the library versions)."""

from __future__ import annotations

import platform

import torch
import transformers
from sqlalchemy.orm import Session

from ffmem.engine.mining.corpus import held_out_sentences
from ffmem.engine.model.loaded import LoadedModel
from ffmem.store import runs, vocabularies
from ffmem.store.specs import RunSpec


def provenance(loaded: LoadedModel, corpus, spec: RunSpec, shard_sentences: int) -> dict:
    """How a run of `spec` over the stored `corpus` with `loaded`, in shards of `shard_sentences`, is made
    (its `provenance` column)."""
    return {
        "model_source": loaded.source,
        "model_revision": loaded.revision,
        "weights_sha256": loaded.weights_sha256,
        "architecture": type(loaded.model).__name__,
        "corpus": corpus.name,
        "corpus_sha256": corpus.source_sha256,
        "sentences": corpus.n_sentences,
        "held_out_every": spec.held_out_every,
        "held_out": _held_out_rule(corpus.n_sentences, spec.held_out_every),
        "shard_order": "shard k of n mines every n-th mined sentence from the k-th: each spans the corpus",
        "max_sentence_tokens": spec.max_sentence_tokens,
        "first_position": spec.first_position,
        "mined_positions": _mined_positions(loaded, spec.first_position),
        "batch_tokens": spec.batch_tokens,
        "shard_sentences": shard_sentences,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _held_out_rule(n_sentences: int, every: int) -> str:
    """Which sentences the run holds out of mining, in words
    (ffmem.engine.mining.corpus.held_out_sentences)."""
    if not every:
        return "none: every sentence read is mined"
    held = len(held_out_sentences(n_sentences, every))
    return (
        f"every {every}th sentence (index % {every} = {every - 1}): {held:,} sentences, not mined; "
        "the analyses and the explanations' scores read them"
    )


def _mined_positions(loaded: LoadedModel, first_position: bool) -> str:
    """The run's position policy in words (ffmem.engine.mining.corpus.mined_from)."""
    if loaded.bos_prepended:
        where = f"from 1: the tokenizer puts {loaded.tokenizer.bos_token} first (never mined)"
    elif first_position:
        where = "from 0: the tokenizer puts no BOS first; the first token (attention sink) is mined"
    else:
        where = "from 1: the tokenizer puts no BOS first; the first token (attention sink) is not mined"
    return f"{where}. Triggers and every statistic (histogram, mean, shares, tokens) cover these positions"


def store_model(session: Session, loaded: LoadedModel):
    """The model's row (created or updated) and its vocabulary, stored; returns the row."""
    config = loaded.config
    model_row = runs.upsert_model(
        session=session,
        slug=loaded.slug,
        source=loaded.source,
        revision=loaded.revision,
        architecture=type(loaded.model).__name__,
        family=loaded.adapter.family,
        n_layers=loaded.n_layers,
        n_keys=loaded.n_keys,
        d_model=config.hidden_size if hasattr(config, "hidden_size") else config.n_embd,
        vocab_size=loaded.vocab_size,
        activation=loaded.adapter.activation(config),
        gated=loaded.adapter.gates is not None,
    )
    ids = list(range(len(loaded.tokenizer)))
    padding = [f"⟨unused {i}⟩" for i in range(len(ids), loaded.vocab_size)]  # rows no token reads in
    vocabularies.store_vocabulary(
        session=session,
        model_id=model_row.id,
        texts=[loaded.tokenizer.decode([i]) for i in ids] + padding,
        pieces=[str(p) for p in loaded.tokenizer.convert_ids_to_tokens(ids)] + padding,
    )
    return model_row
