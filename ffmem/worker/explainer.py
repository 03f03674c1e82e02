"""An optional local model that writes the memories' descriptions (ffmem.worker.explanations): with
`explainer_url` set, a model behind that OpenAI-compatible URL gets, for each side of a memory (m > 0,
m < 0), what it reads and what it writes together — the ends of its strongest trigger prefixes of that
sign, its value's projection on the vocabulary on that side (VocabProj: the tokens it promotes and those it
suppresses there) and, where the run stored them, the tokens whose probability moves most when it is
amplified (TokenChange) — and answers in JSON with a one-sentence description and the endings its pattern
matches (a one-token ending weighs 1 at that token, a longer one 1 at its last two tokens,
ffmem.engine.explanations.fitting.Pattern), scored by the same protocol; a side it fails on (an error, a
timeout, an answer that is no such JSON) keeps the heuristic description, and the run's explanations step
counts the failures (the job page says so). The same endpoint can **simulate** a side's coefficients on
text from its description (`simulate`: 0–10 a token, OpenAI's simulator), for the field's simulation
score. Nothing is sent anywhere unless the setting is set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import httpx

from ffmem.engine.explanations.description import Description
from ffmem.engine.explanations.fitting import MAX_PAIRS, MAX_TOKENS, Pattern

PROMPT_PREFIXES = 10  # trigger prefixes a prompt shows
PROMPT_TOKENS = 12  # the last tokens of each, the trigger token among them
GIVE_UP = 20  # failures in a row after which a run's explainer stops asking (a server down or too slow)


@dataclass
class Evidence:
    """What the index knows about one side of one memory."""

    layer: int
    key: int
    sign: int  # the side: +1, where m > 0; −1, where m < 0
    # the ends (PROMPT_TOKENS) of its top PROMPT_PREFIXES trigger prefixes of that sign, strongest first:
    # what a prompt shows, no more
    prefixes: list[list[int]]
    value_tokens: list[int]  # what the value writes on that side (norm readout: top tokens for +1,
    # bottom ones for −1), the strongest first
    shallowness: float | None
    heuristic: Description  # read off the rest (ffmem.engine.explanations.description.describe)
    suppressed: list[int] = field(default_factory=list)  # the tokens the value pushes down on that side
    token_change: list[int] | None = None  # TokenChange's risers where the run stored them (None: not)


PROMPT = """You describe one side of one memory of a transformer language model's feed-forward layer: \
where its coefficient m is {side}.
What it reads: it is strongest on the last token of these text prefixes (the trigger token is in ⟦ ⟧):
{prefixes}
What it writes when it fires there: its value promotes {promoted} and suppresses {suppressed} (its \
projection on the vocabulary){token_change}.
Automatic summary: {heuristic}
Answer in JSON only: {{"description": "<one sentence, at most 20 words: what it reads and what it \
writes>", "ends_with": ["<tokens or short phrases the prefixes end with>"]}}"""

SIMULATE = """A memory of a language model is described as: {description}
For each numbered text below, rate how strongly the memory fires on each of its tokens, from 0 (not at all) \
to 10 (its strongest). The tokens of a text are separated by ⟨|⟩.
{records}
Answer in JSON only: {{"activations": [[<one number per token of text 1>], [<text 2>], ...]}}"""


class LocalExplainer:
    """Descriptions written by a local model behind an OpenAI-compatible URL (`/chat/completions`):
    `model` names it in each request when set; `texts`: each token id's text; `client` defaults to one
    for `url`."""

    def __init__(
        self, url: str, model: str, timeout: float, tokenizer, texts: list[str], client=None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.texts = texts
        self.client = client or httpx.Client(base_url=url, timeout=timeout)
        self.failures_in_row = 0

    @property
    def gave_up(self) -> bool:
        """Whether it has stopped asking: GIVE_UP failures in a row (every later side keeps its heuristic
        description, unasked)."""
        return self.failures_in_row >= GIVE_UP

    def prompt(self, evidence: Evidence) -> str:
        shown = []
        for ids in evidence.prefixes[:PROMPT_PREFIXES]:
            head = "".join(self.texts[t] for t in ids[-PROMPT_TOKENS:-1])
            shown.append(f"- …{head}⟦{self.texts[ids[-1]]}⟧")
        change = ""
        if evidence.token_change:
            change = (
                "; amplified, it raises the probability of " + self._tokens(evidence.token_change) + " most"
            )
        return PROMPT.format(
            side="positive (m > 0)" if evidence.sign > 0 else "negative (m < 0)",
            prefixes="\n".join(shown) or "(none)",
            promoted=self._tokens(evidence.value_tokens) or "nothing stored",
            suppressed=self._tokens(evidence.suppressed) or "nothing stored",
            token_change=change,
            heuristic=evidence.heuristic.text,
        )

    def _tokens(self, ids: list[int]) -> str:
        return ", ".join(json.dumps(self.texts[t], ensure_ascii=False) for t in ids)

    def _ask(self, prompt: str) -> dict | None:
        """The JSON object the model answers `prompt` with, or None: an error, a timeout, no JSON object (or
        it gave up: `gave_up`)."""
        if self.gave_up:
            return None
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0}
        if self.model:
            body["model"] = self.model
        try:
            answer = self.client.post("chat/completions", json=body)
            answer.raise_for_status()
            content = answer.json()["choices"][0]["message"]["content"]
            found = json.loads(re.search(r"\{.*\}", content, re.S).group(0))
        except (httpx.HTTPError, KeyError, IndexError, TypeError, AttributeError, ValueError):
            found = None
        if not isinstance(found, dict):
            self.failures_in_row += 1
            return None
        self.failures_in_row = 0
        return found

    def simulate(self, description: str, records: list[list[int]]) -> list[list[float]] | None:
        """The model's simulated coefficients of a side described so, 0–10 at each token of each record
        (token ids), or None when it gave no answer of those lengths."""
        shown = "\n".join(
            f"{i + 1}. " + "⟨|⟩".join(self.texts[t] for t in ids) for i, ids in enumerate(records)
        )
        found = self._ask(SIMULATE.format(description=description, records=shown))
        rows = found.get("activations") if found else None
        if not isinstance(rows, list) or len(rows) != len(records):
            return None
        try:
            simulated = [[float(x) for x in row] for row in rows]
        except (TypeError, ValueError):
            return None
        if any(len(row) != len(ids) for row, ids in zip(simulated, records, strict=True)):
            return None
        return simulated

    def describe(self, evidence: Evidence) -> Description | None:
        """The local model's description of one side of a memory, or None when it gave no usable answer."""
        found = self._ask(self.prompt(evidence))
        try:
            text = str(found["description"]).strip()
        except (KeyError, TypeError):
            return None
        if not text:
            return None
        final, pairs = [], []
        for phrase in _strings(found.get("ends_with")):
            ids = self._ids(phrase)
            if len(ids) == 1 and len(final) < MAX_TOKENS and ids[0] not in final:
                final.append(ids[0])
            elif len(ids) > 1 and len(pairs) < MAX_PAIRS and ids[-2:] not in pairs:
                pairs.append(ids[-2:])
        pattern = Pattern(
            sign=evidence.heuristic.pattern.sign,
            final=final,
            weights=[1.0] * len(final),
            pairs=pairs,
            pair_weights=[1.0] * len(pairs),
        )
        return Description(text=text[:500], pattern=pattern)

    def _ids(self, phrase: str) -> list[int]:
        """The phrase's token ids as the prefixes would hold it: with a leading space when it fits in fewer
        tokens that way (a word inside a sentence)."""
        plain = self.tokenizer(phrase, add_special_tokens=False).input_ids
        spaced = self.tokenizer(" " + phrase.lstrip(), add_special_tokens=False).input_ids
        return spaced if len(spaced) <= len(plain) else plain


def _strings(value) -> list[str]:
    """The non-blank strings of a JSON list (nothing when it is no list)."""
    return [v for v in value if isinstance(v, str) and v.strip()] if isinstance(value, list) else []
