"""An index run, end to end: load → corpus → mine (checkpointed per shard) → project → store.

The running top-T is checkpointed to the cache folder after every shard; running the same
index again after a crash resumes from the last finished shard and gives the same result.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from app import queries
from engine.corpus import read_corpus, tokenize
from engine.loading import LoadedModel, load_model
from engine.mining import MiningState, mine_batches, shard_batches
from engine.projection import project_layer, value_norms


@dataclass
class IndexOptions:
    model: str = "smollm2-135m"
    corpus: str = "wiki-vital"
    sentences: int | None = 2000
    top_k: int = 50
    device: str = "auto"
    dtype: str = "auto"
    max_sentence_tokens: int = 128
    batch_tokens: int = 4096
    shard_sentences: int = 2048
    value_tokens: int = 30
    cache_dir: Path = Path("data/cache")
    progress: bool = True


@dataclass
class IndexSummary:
    run_id: int
    model: str
    corpus: str
    sentences: int
    tokens: int
    layers: int
    keys: int
    triggers: int
    value_tokens: int
    padding_efficiency: float
    resumed_shards: int
    mining_seconds: float
    projection_seconds: float
    storing_seconds: float


def build_index(
    options: IndexOptions, sessions: sessionmaker, loaded: LoadedModel | None = None
) -> IndexSummary:
    """Build (or resume) one index run and store it; returns what was stored."""
    started_at = datetime.now(timezone.utc)
    loaded = loaded or load_model(
        options.model, device=options.device, dtype=options.dtype, cache_dir=options.cache_dir
    )
    text = read_corpus(options.corpus, options.sentences)
    tokenizer_name = f"{loaded.slug}@{loaded.revision or 'unknown'}"
    fingerprint = _sha(
        {
            "corpus": text.sha256,
            "n": len(text.sentences),
            "tokenizer": tokenizer_name,
            "max_tokens": options.max_sentence_tokens,
        }
    )
    with sessions() as session:
        model_row = _store_model(session, loaded)
        corpus = queries.find_corpus(session=session, fingerprint=fingerprint)
        if corpus is None:
            tokenized = tokenize(text.sentences, loaded.tokenizer, options.max_sentence_tokens)
            corpus = queries.store_corpus(
                session=session,
                name=text.name,
                source=text.source,
                source_sha256=text.sha256,
                fingerprint=fingerprint,
                tokenizer=tokenizer_name,
                max_tokens=options.max_sentence_tokens,
                skipped=dict(text.skipped),
                sentences=((s.text, s.token_ids, s.offsets, s.first_position) for s in tokenized),
            )
        session.commit()
        token_ids = queries.load_sentence_tokens(session=session, corpus_id=corpus.id)
        first_positions = queries.load_first_positions(session=session, corpus_id=corpus.id)
        corpus_id, corpus_name, corpus_sha = corpus.id, corpus.name, corpus.source_sha256
        model_id = model_row.id

    # ---- mining, one shard at a time, checkpointed --------------------------------------------
    checkpoint = (
        Path(options.cache_dir)
        / "checkpoints"
        / (
            _sha(
                {
                    "model": loaded.revision or loaded.source,
                    "slug": loaded.slug,
                    "corpus": fingerprint,
                    "top_k": options.top_k,
                    "dtype": str(loaded.dtype),
                    "shard": options.shard_sentences,
                }
            )
            + ".pt"
        )
    )
    n_shards = -(-len(token_ids) // options.shard_sentences)
    state, done = _resume(checkpoint, loaded)
    if state is None:
        state = MiningState(loaded.n_layers, loaded.n_keys, options.top_k, device=loaded.device)
    pad_id = _pad_id(loaded)
    real = computed = 0
    started = time.perf_counter()
    bar = tqdm(
        total=len(token_ids),
        unit="sent",
        desc=f"mining {loaded.slug}",
        disable=not options.progress,
        initial=sum(
            min(options.shard_sentences, len(token_ids) - s * options.shard_sentences) for s in range(done)
        ),
    )
    mined_tokens = 0

    def advance(batch) -> None:
        nonlocal real, computed, mined_tokens
        real += batch.real_tokens
        computed += batch.computed_tokens
        mined_tokens += batch.real_tokens
        elapsed = time.perf_counter() - started
        bar.set_postfix_str(
            f"{mined_tokens / max(elapsed, 1e-9):,.0f} tok/s, padding eff. {real / computed:.1%}"
        )
        bar.update(len(batch.sentence_index))

    for shard in range(done, n_shards):
        batches = shard_batches(
            token_ids,
            first_positions,
            shard=shard,
            shard_sentences=options.shard_sentences,
            batch_tokens=options.batch_tokens,
            pad_id=pad_id,
        )
        mine_batches(loaded, batches, state, on_batch=advance)
        _save_checkpoint(checkpoint, state, shard + 1)
    bar.close()
    mining_seconds = time.perf_counter() - started

    # ---- projection and storage, layer by layer -------------------------------------------------
    provenance = {
        "model_source": loaded.source,
        "model_revision": loaded.revision,
        "architecture": type(loaded.model).__name__,
        "corpus": corpus_name,
        "corpus_sha256": corpus_sha,
        "sentences": len(token_ids),
        "max_sentence_tokens": options.max_sentence_tokens,
        "batch_tokens": options.batch_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    following = _following_tokens(token_ids)
    projection_seconds = storing_seconds = 0.0
    triggers = value_token_rows = 0
    with sessions() as session:
        run = queries.create_run(
            session=session,
            model_id=model_id,
            corpus_id=corpus_id,
            top_k=options.top_k,
            n_value_tokens=options.value_tokens,
            n_sentences=len(token_ids),
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
            package_version=version("ffmem"),
            provenance=provenance,
            histogram_edges=state.edges,
            started_at=started_at,
        )
        session.commit()
        run_id = run.id
        try:
            for layer in tqdm(
                range(loaded.n_layers),
                desc="projecting and storing",
                unit="layer",
                disable=not options.progress,
            ):
                t0 = time.perf_counter()
                _, sentence, position = state.triggers(layer, 1)  # [keys, T] each
                next_tokens = next_token_ids(following, sentence, position)  # [keys, T]
                projected = list(
                    project_layer(loaded, layer, options.value_tokens, targets=next_tokens[:, 0])
                )
                norms = value_norms(loaded, layer)
                t1 = time.perf_counter()
                triggers += _store_layer(session, run_id, layer, state, projected, norms, next_tokens)
                value_token_rows += sum(p.token_ids.numel() for p in projected)
                session.commit()
                projection_seconds += t1 - t0
                storing_seconds += time.perf_counter() - t1
            queries.finish_run(session=session, run_id=run_id, n_tokens=state.positions)
            session.commit()
        except BaseException as error:
            session.rollback()
            queries.fail_run(session=session, run_id=run_id, error=error)
            session.commit()
            raise
    checkpoint.unlink(missing_ok=True)
    return IndexSummary(
        run_id=run_id,
        model=loaded.slug,
        corpus=corpus_name,
        sentences=state.sentences,
        tokens=state.positions,
        layers=loaded.n_layers,
        keys=loaded.n_keys,
        triggers=triggers,
        value_tokens=value_token_rows,
        padding_efficiency=real / computed if computed else 1.0,
        resumed_shards=done,
        mining_seconds=mining_seconds,
        projection_seconds=projection_seconds,
        storing_seconds=storing_seconds,
    )


def _store_model(session: Session, loaded: LoadedModel):
    config = loaded.config
    model_row = queries.upsert_model(
        session=session,
        slug=loaded.slug,
        source=loaded.source,
        revision=loaded.revision,
        architecture=type(loaded.model).__name__,
        family=loaded.adapter.family,
        n_layers=loaded.n_layers,
        n_keys=loaded.n_keys,
        d_model=config.hidden_size if hasattr(config, "hidden_size") else config.n_embd,
        vocab_size=len(loaded.tokenizer),
        activation=loaded.adapter.activation(config),
        gated=loaded.adapter.gates is not None,
    )
    ids = list(range(len(loaded.tokenizer)))
    queries.store_vocabulary(
        session=session,
        model_id=model_row.id,
        texts=[loaded.tokenizer.decode([i]) for i in ids],
        pieces=[str(p) for p in loaded.tokenizer.convert_ids_to_tokens(ids)],
    )
    return model_row


def _following_tokens(token_ids: list[list[int]]) -> torch.Tensor:
    """[sentences, max_len + 1]: the token after each position (−1 past a sentence's end)."""
    following = torch.full((len(token_ids), max(map(len, token_ids), default=0) + 1), -1, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        following[row, : len(ids) - 1] = torch.tensor(ids[1:], dtype=torch.long)
    return following


def next_token_ids(following: torch.Tensor, sentence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The token that follows each trigger prefix ([keys, T]; −1 at a sentence's end or an empty slot)."""
    found = following[sentence.clamp(min=0), position]  # [keys, T]
    return torch.where(sentence >= 0, found, -1)


def _store_layer(
    session: Session,
    run_id: int,
    layer: int,
    state: MiningState,
    projected,
    norms,
    next_tokens: torch.Tensor,
) -> int:
    """Store one layer's triggers (both signs), key statistics and value tokens; returns triggers stored.

    Key–value agreement: how many of a key's positive triggers are followed by one of its value's
    top raw tokens; and the raw rank of the token after its top trigger (the paper's Figs. 4–5).
    """
    raw_top = next(p for p in projected if p.readout == "raw" and p.direction == 1)
    agrees = (next_tokens[:, :, None] == raw_top.token_ids[:, None, :]).any(dim=-1)  # [keys, T]
    stored = 0
    for sign in (1, -1):
        coefficients, sentence, position = state.triggers(layer, sign)  # [keys, T] each
        stored += queries.store_triggers(
            session=session,
            run_id=run_id,
            layer=layer,
            sign=sign,
            coefficients=coefficients.numpy(),
            sentence_index=sentence.numpy(),
            position=position.numpy(),
        )
    top, _, _ = state.triggers(layer, 1)
    bottom, _, _ = state.triggers(layer, -1)
    queries.store_key_stats(
        session=session,
        run_id=run_id,
        layer=layer,
        mean=state.mean(layer).numpy(),
        positive_share=state.positive_share(layer).numpy(),
        max_coefficient=top[:, 0].numpy(),
        min_coefficient=bottom[:, 0].numpy(),
        value_norm=norms.numpy(),
        histogram=state.histogram[layer].cpu().numpy(),
        density=state.density(layer).numpy(),
        max_prob=raw_top.probs[:, 0].numpy(),
        agreement=(agrees & (next_tokens >= 0)).sum(dim=-1).numpy(),
        next_token_rank=raw_top.target_rank.numpy(),
    )
    for p in projected:
        queries.store_value_tokens(
            session=session,
            run_id=run_id,
            layer=layer,
            readout=p.readout,
            direction=p.direction,
            token_ids=p.token_ids.numpy(),
            logits=p.logits.numpy(),
            probs=p.probs.numpy(),
        )
    return stored


def _resume(checkpoint: Path, loaded: LoadedModel) -> tuple[MiningState | None, int]:
    if not checkpoint.exists():
        return None, 0
    saved = torch.load(checkpoint, weights_only=True)
    return MiningState.from_state_dict(saved["state"], device=loaded.device), saved["shards_done"]


def _save_checkpoint(checkpoint: Path, state: MiningState, shards_done: int) -> None:
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    partial = checkpoint.with_suffix(".partial")
    torch.save({"state": state.state_dict(), "shards_done": shards_done}, partial)
    partial.replace(checkpoint)  # atomic: a crash mid-write keeps the previous checkpoint


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def _sha(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
