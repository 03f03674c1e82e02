"""An optional local model that writes the memories' descriptions (ffmem.worker.explanations): with
`explainer_url` set, a model behind that OpenAI-compatible URL gets the same evidence as the heuristic
description, answers in JSON with the endings its pattern matches (a one-token ending weighs 1 at that
token, a longer one 1 at its last two tokens, ffmem.engine.explanations.fitting.Pattern), and is scored the
same way; a key it fails on keeps the heuristic description. Nothing is sent anywhere unless the setting is
set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx

from ffmem.engine.explanations.description import Description
from ffmem.engine.explanations.fitting import MAX_PAIRS, MAX_TOKENS, Pattern

PROMPT_PREFIXES = 10  # trigger prefixes a prompt shows
PROMPT_TOKENS = 12  # the last tokens of each, the trigger token among them


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


PROMPT = """You describe one memory of a transformer language model's feed-forward layer.
Its key fires most strongly on the last token of these text prefixes (the trigger token is in ⟦ ⟧):
{prefixes}
Automatic summary: {heuristic}
Answer in JSON only: {{"description": "<at most 15 words: what the prefixes have in common>", \
"ends_with": ["<tokens or short phrases the prefixes end with>"]}}"""


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

    def prompt(self, evidence: Evidence) -> str:
        shown = []
        for ids in evidence.prefixes[:PROMPT_PREFIXES]:
            head = "".join(self.texts[t] for t in ids[-PROMPT_TOKENS:-1])
            shown.append(f"- …{head}⟦{self.texts[ids[-1]]}⟧")
        return PROMPT.format(prefixes="\n".join(shown) or "(none)", heuristic=evidence.heuristic.text)

    def describe(self, evidence: Evidence) -> Description | None:
        """The local model's description of one memory, or None when it gave no usable answer."""
        body = {"messages": [{"role": "user", "content": self.prompt(evidence)}], "temperature": 0}
        if self.model:
            body["model"] = self.model
        try:
            answer = self.client.post("chat/completions", json=body)
            answer.raise_for_status()
            content = answer.json()["choices"][0]["message"]["content"]
            found = json.loads(re.search(r"\{.*\}", content, re.S).group(0))
            text = str(found["description"]).strip()
        except (httpx.HTTPError, KeyError, IndexError, TypeError, AttributeError, ValueError):
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
