"""The search page: memories by value token (both signs, over every memory's whole readout), sentences by
text (with the keys they trigger), labels and explanations by text, or a jump to the key `L12 K345` names."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from ffmem.engine.live.protocol import MAX_SEARCH_MEMORIES
from ffmem.store import corpora, memory_labels, memory_reads, vocabularies
from ffmem.store.db import Session
from ffmem.store.memory_lists import ValueToken
from ffmem.store.models import LanguageModel, Run
from ffmem.web import token_search, urls
from ffmem.web.display import visible
from ffmem.web.errors import AppError
from ffmem.web.lookups import check_key, run_or_404
from ffmem.web.pages.composition import ExplanationHit, explanation_hits
from ffmem.web.token_search import Depth, TokenHit
from ffmem.web.views import LabelHit, ModelPage, RunInfo, label_view, run_info, trigger_token_ids
from ffmem.web.worker_client import LiveWorker

KEY_JUMP = re.compile(
    r"^\s*(?:L\s*)?(\d+)\s*(?:/|\s+|,)\s*(?:K\s*)?(\d+)\s*$|^\s*L\s*(\d+)\s*K\s*(\d+)\s*$", re.I
)
VISIBLE_SPACE = "\u2423"  # ␣


class TokenMatch(BaseModel):
    """A memory whose value promotes (a high logit) or suppresses (a low one) a searched token."""

    layer: int
    key: int
    direction: int = Field(description="+1 promotes, −1 suppresses.")
    rank: int | None = Field(
        description="The token's rank in the value's readout, from the top (+1) or bottom (−1), 0 "
        "first; null: "
        "not among the value's stored top / bottom n_value_tokens (the rank is known only there)."
    )
    token: str
    token_id: int
    logit: float = Field(description="The token's logit in the value's readout.")
    prob: float = Field(description="Its probability: softmax of the value's logits over the vocabulary.")


class TextPart(BaseModel):
    """A piece of a sentence: the searched text (`marked`) or what lies between its occurrences."""

    text: str
    marked: bool


class SentenceKey(BaseModel):
    """A key one of whose top positive triggers is this sentence, up to a token at or past the match."""

    layer: int
    key: int
    coefficient: float = Field(description="m at the trigger token.")
    position: int = Field(description="The trigger token's position in the sentence.")
    trigger_token: str
    trigger_token_id: int
    url: str


class SentenceMatch(BaseModel):
    """A sentence that contains the searched text (each occurrence marked), with the keys it triggers."""

    sentence_indices: list[int] = Field(
        description="The corpus sentences with this text (a repeated sentence is one row)."
    )
    parts: list[TextPart] = Field(description="The sentence, cut at the occurrences of the text.")
    keys: list[SentenceKey] = Field(description="The strongest first.")


class SearchContext(ModelPage):
    """What a search found in one index run."""

    page: str = "search"
    n_layers: int
    n_keys: int
    run: RunInfo
    q: str = Field(description="What was searched: a token, a text, or L12 K345.")
    readout: str = Field(description="raw: v·E; norm: lm_head(final_norm(v)).")
    by: str = Field(description="Token matches ranked by prob or logit.")
    limit: int = Field(description="Results per section.")
    token_ids: list[int] = Field(
        description="The vocabulary entries q means (as typed, and with a leading space)."
    )
    promote: list[TokenMatch]
    suppress: list[TokenMatch]
    token_coverage: str = Field(
        "full",
        description="full: every memory of every layer ranked by the token's logit in its value's whole "
        "readout; stored: only values with the token among their stored top / bottom tokens (runs stored "
        "before 0018: index them again for full).",
    )
    memories: int = Field(0, description="Memories ranked (full).")
    depth: Depth = Field(
        Depth(),
        description="How deep the token sections go (full): the stored depth and what lies past it.",
    )
    sentences: list[SentenceMatch] = Field(
        [], description="Sentences that contain q, one row each, with the keys they trigger."
    )
    labels: list[LabelHit] = Field([], description="Memories whose label matches q.")
    explanations: list[ExplanationHit] = Field(
        [], description="Memories whose automatic explanation contains q."
    )
    max_length: int = Field(200, description="The longest q the server accepts.")
    max_limit: int = Field(MAX_SEARCH_MEMORIES, description="The largest limit the server accepts.")
    key_url: str | None = Field(
        None, description="The key page q names (L12 K345), opened when the form is sent."
    )


def search_page(
    session: Session,
    model: LanguageModel,
    *,
    q: str,
    pinned: int | None,
    readout: str,
    by: str,
    limit: int,
    max_length: int,
    jump: bool = True,
    keys: bool = True,
    live: LiveWorker | None = None,
    timeout: float | None = None,
) -> SearchContext | str:
    """The search results, or the URL of a key when `q` names one (`L12 K345`, `12/345`) and `jump` (else
    the results with that URL: as-you-type searches jump only when the form is sent). `pinned`: the run the
    URL pins; its run is looked up only when there is no key to jump to. `keys=False`: `q` names no key (a
    key the model lacks, refused next to the box: the results of q as text)."""
    slug = model.slug
    named = named_key(model, q) if keys else None
    key_url = urls.key_url(slug, *named, run=pinned) if named else None
    if key_url and jump:
        return key_url
    run = run_or_404(session, model, pinned)
    token_ids = token_candidates(session, model, q) if q else []
    promote, suppress, coverage, ranked = token_matches(
        session, model, run, token_ids, readout=readout, by=by, limit=limit, live=live, timeout=timeout
    )
    label_hits: list[LabelHit] = []
    sentences: list[SentenceMatch] = []
    if len(q.strip()) >= 2:
        sentences = sentence_matches(session, model, run, q, limit)
        label_hits = [
            LabelHit(
                layer=label.layer,
                key=label.key,
                url=urls.key_url(slug, label.layer, label.key),
                **label_view(label).model_dump(),
            )
            for label in memory_labels.search_labels(
                session=session, model_id=model.id, text=q.strip(), limit=limit
            )
        ]
    return SearchContext(
        title=f"{model.slug}: search",
        model=model.slug,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        q=q,
        readout=readout,
        by=by,
        limit=limit,
        token_ids=token_ids,
        promote=promote,
        suppress=suppress,
        token_coverage=coverage,
        memories=ranked.memories if ranked else 0,
        depth=ranked.depth if ranked else Depth(),
        sentences=sentences,
        labels=label_hits,
        explanations=explanation_hits(session, slug, run, q, limit),
        max_length=max_length,
        key_url=key_url,
    )


def token_matches(
    session: Session,
    model: LanguageModel,
    run: Run,
    token_ids: list[int],
    *,
    readout: str,
    by: str,
    limit: int,
    live: LiveWorker | None = None,
    timeout: float | None = None,
) -> tuple[list[TokenMatch], list[TokenMatch], str, token_search.Ranked | None]:
    """(promoting, suppressing, coverage, what was ranked): the memories whose values promote or suppress
    these tokens — every memory ranked ("full", from the run's token → memories table, past its depth from
    `live`), or, for a run stored before that table, the values with them among their stored top / bottom
    tokens ("stored")."""
    if not token_ids:
        return [], [], "full", None
    texts = vocabularies.token_texts(session=session, model_id=model.id, token_ids=token_ids)

    def matches(direction: int, found: list[TokenHit] | list[ValueToken]) -> list[TokenMatch]:
        return [
            TokenMatch(
                layer=m.layer,
                key=m.key,
                direction=direction,
                rank=m.rank,
                token=texts[m.token_id],
                token_id=m.token_id,
                logit=m.logit,
                prob=m.prob,
            )
            for m in found
        ]

    ranked = token_search.rank_memories(
        session, model, run, token_ids, readout=readout, by=by, limit=limit, live=live, timeout=timeout
    )
    if ranked is not None:
        return matches(1, ranked.promote), matches(-1, ranked.suppress), "full", ranked
    stored = {
        direction: memory_reads.value_matches(
            session=session,
            run_id=run.id,
            token_ids=token_ids,
            readout=readout,
            direction=direction,
            by=by,
            limit=limit,
        )
        for direction in (1, -1)
    }
    return matches(1, stored[1]), matches(-1, stored[-1]), "stored", None


def named_key(model: LanguageModel, q: str) -> tuple[int, int] | None:
    """The (layer, key) that `q` names (`L12 K345`, `12/345`), or None; a key the model lacks is a 404
    about `q` (shown next to the search box)."""
    jump = KEY_JUMP.match(q)
    if not jump:
        return None
    layer, key = (int(g) for g in jump.groups() if g is not None)
    try:
        check_key(model, layer, key)
    except AppError as error:
        error.field = "q"
        raise
    return layer, key


def token_candidates(session: Session, model: LanguageModel, text: str) -> list[int]:
    """Vocabulary ids a typed token means: the text as typed, and with a leading space when it has none.

    A leading ␣ (how the explorer shows a space) is read as a space; a text with ⟨…⟩ in it (a byte that is
    no character, ⟨0x80⟩, or an invisible one, ⟨U+200B⟩) is matched as the pages show tokens.
    """
    if "⟨" in text:
        forms = {text} if text.startswith(VISIBLE_SPACE) else {text, VISIBLE_SPACE + text}
        known = vocabularies.vocabulary(session=session, model_id=model.id)
        return sorted(token_id for token_id, token in known.items() if visible(token) in forms)
    if text.startswith(VISIBLE_SPACE):
        text = " " + text[1:]
    forms = {text} if text.startswith(" ") or not text.strip() else {text, " " + text}
    return vocabularies.find_tokens(session=session, model_id=model.id, texts=forms)


def sentence_matches(
    session: Session, model: LanguageModel, run: Run, text: str, limit: int
) -> list[SentenceMatch]:
    """Sentences that contain `text` (ignoring case), one row each (a text the corpus holds twice is one
    row), every occurrence marked, with the keys whose positive triggers they are up to a token at or past
    the first occurrence's end: the `limit` strongest such triggers over all sentences, grouped by
    sentence, the sentence of the strongest first."""
    needle = vocabularies.stored_text(text).lower()
    found = corpora.sentences_containing(session=session, corpus_id=run.corpus_id, text=text, limit=50)
    first_positions = {}
    for sentence in found:
        end = sentence.text.lower().find(needle) + len(needle)  # the first occurrence's end
        first_positions[sentence.index] = next(
            (p for p, (_, stop) in enumerate(sentence.offsets) if stop >= end), len(sentence.offsets)
        )
    rows = memory_reads.triggers_from(
        session=session, run_id=run.id, n_keys=model.n_keys, first_positions=first_positions, limit=limit
    )
    by_index = {s.index: s for s in found}
    texts = vocabularies.token_texts(
        session=session, model_id=model.id, token_ids=trigger_token_ids(rows, by_index)
    )
    grouped: dict[str, tuple[list[int], list[SentenceKey]]] = {}  # a text the corpus repeats: one row
    for t in rows:  # the strongest first: so are the rows, and the keys within each
        sentence = by_index[t.sentence_index]
        indices, keys = grouped.setdefault(sentence.text, ([], []))
        if t.sentence_index not in indices:
            indices.append(t.sentence_index)
        if any((k.layer, k.key, k.position) == (t.layer, t.key, t.position) for k in keys):
            continue  # the same key on a copy of the sentence
        token_id = sentence.token_ids[t.position]
        keys.append(
            SentenceKey(
                layer=t.layer,
                key=t.key,
                coefficient=t.coefficient,
                position=t.position,
                trigger_token=texts.get(token_id, ""),
                trigger_token_id=token_id,
                url=urls.key_url(model.slug, t.layer, t.key, run=run.id),
            )
        )
    return [
        SentenceMatch(sentence_indices=sorted(indices), parts=marked_parts(sentence_text, text), keys=keys)
        for sentence_text, (indices, keys) in grouped.items()
    ]


def marked_parts(sentence: str, text: str) -> list[TextPart]:
    """`sentence` cut at every occurrence of `text` (any case; a ␣ typed means a space, as stored)."""
    needle = vocabularies.stored_text(text)
    if needle.startswith(VISIBLE_SPACE):
        needle = " " + needle[1:]
    parts: list[TextPart] = []
    end = 0
    for match in re.finditer(re.escape(needle), sentence, flags=re.IGNORECASE) if needle else ():
        if match.start() > end:
            parts.append(TextPart(text=sentence[end : match.start()], marked=False))
        parts.append(TextPart(text=match.group(), marked=True))
        end = match.end()
    if end < len(sentence):
        parts.append(TextPart(text=sentence[end:], marked=False))
    return parts
