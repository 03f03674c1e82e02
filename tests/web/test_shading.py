"""The shared shading component: ffmem.web.shading.shade builds a ShadedText, `shaded` (the templates'
global, shading.shaded_html) renders it (sign-aware hue, |m| / scale intensity, value on hover and for
screen readers, the peak outlined, the prefix boundary, every text escaped)."""

from __future__ import annotations

import re
from xml.etree import ElementTree

import pytest

from ffmem.web.rendering import templates
from ffmem.web.shading import intensity, shade, shaded_html, token_pieces


def render(text, **kwargs) -> ElementTree.Element:
    """The markup a template gets, parsed (it is well-formed XML: spans and escaped text only)."""
    template = templates.env.from_string("{{ shaded(text, **kw) }}")
    return ElementTree.fromstring(template.render(text=text, kw=kwargs))


def tokens(root: ElementTree.Element) -> list[ElementTree.Element]:
    return [s for s in root if "stok" in s.get("class", "").split()]


def said(element: ElementTree.Element) -> str:
    """What a screen reader adds after a token: its visually hidden text."""
    return "".join("".join(s.itertext()) for s in element if s.get("class") == "sr-only")


def test_shade_builds_the_model():
    text = shade([" a", " b", " c"], [0.5, -2.0, None], peak=1, prefix_end=1)
    assert text.model_dump() == {
        "tokens": [
            {"text": " a", "coefficient": 0.5},
            {"text": " b", "coefficient": -2.0},
            {"text": " c", "coefficient": None},
        ],
        "scale": 2.0,
        "peak": 1,
        "prefix_end": 1,
    }
    assert shade(["x"], [1.0], scale=4.0).scale == 4.0
    assert shade([], []).scale == 0.0
    assert [intensity(m, 2.0) for m in (0.5, -2.0, -3.0, 0.0, None)] == [0.25, 1.0, 1.0, 0.0, 0.0]
    assert intensity(1.0, 0.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"texts": ["a"], "coefficients": []}, "1 token texts but 0 coefficients"),
        ({"texts": ["a"], "coefficients": [1.0], "peak": 1}, "peak 1 is outside the 1 tokens"),
        ({"texts": ["a"], "coefficients": [1.0], "prefix_end": -1}, "prefix_end -1 is outside"),
        ({"texts": ["a"], "coefficients": [1.0], "scale": -1.0}, "scale -1.0 is negative"),
    ],
)
def test_shade_refuses_what_does_not_fit(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        shade(kwargs.pop("texts"), kwargs.pop("coefficients"), **kwargs)


def test_each_token_is_shaded_by_sign_and_strength():
    text = shade(["<b>", " x", " y", " z"], [1.0, -0.5, 0.0, 0.25], peak=0, prefix_end=2, scale=2.0)
    root = render(text, id="demo")
    assert root.get("id") == "demo" and root.get("class") == "shaded"
    spans = tokens(root)
    assert [s.get("class") for s in spans] == [
        "stok m-pos peak",
        "stok m-neg",
        "stok prefix-end",
        "stok m-pos past",
    ]
    assert [s.get("style") for s in spans] == ["--m: 0.500", "--m: 0.250", None, "--m: 0.125"]
    assert [s.get("title") for s in spans] == [
        "m = +1, the peak",
        "m = -0.5",
        "m = +0, the end of the trigger prefix",
        "m = +0.25",
    ]
    assert [s.get("data-m") for s in spans] == ["1.0", "-0.5", "0.0", "0.25"]
    # The token's own text, escaped (no element made of it), then its value for screen readers.
    assert [s.text for s in spans] == ["<b>", " x", " y", " z"]
    assert not root.findall(".//b")
    assert [said(s) for s in spans] == [
        " (m = +1, the peak)",
        " (m = -0.5)",
        " (m = +0)",
        " (m = +0.25)",
    ]
    assert said(root) == " (end of the trigger prefix) "
    assert list(root).index(root.find("./span[@class='sr-only']")) == 3  # right after the prefix's end
    # Nothing but the tokens between them: the text reads as it was typed.
    assert root.text is None and all(s.tail is None for s in root)
    assert "".join(s.text for s in spans) == "<b> x y z"


def test_the_peak_leaves_its_leading_space_outside_its_outline():
    """Issue 26: a line that wrapped after the peak's leading space left an empty outlined box at its end.
    The space goes before the peak's span (unshaded, unboxed); every other token keeps its space."""
    html = str(shaded_html(shade([" The", " capital", "\n of"], [0.5, 1.0, -0.5], peak=1), id="t"))
    assert html == (
        '<span class="shaded" id="t">'
        '<span class="stok m-pos" data-index="0" data-m="0.5" style="--m: 0.500" title="m = +0.5"> The'
        '<span class="sr-only"> (m = +0.5)</span></span>'
        ' <span class="stok m-pos peak" data-index="1" data-m="1.0" style="--m: 1.000"'
        ' title="m = +1, the peak">capital<span class="sr-only"> (m = +1, the peak)</span></span>'
        '<span class="stok m-neg" data-index="2" data-m="-0.5" style="--m: 0.500" title="m = -0.5">\n of'
        '<span class="sr-only"> (m = -0.5)</span></span>'
        "</span>"
    )
    newline = render(shade(["a", "\n\tb"], [1.0, 2.0], peak=1))
    assert tokens(newline)[1].text == "b" and tokens(newline)[0].tail == "\n\t"  # any leading whitespace
    assert tokens(render(shade(["a", " "], [1.0, 2.0], peak=1)))[1].text == " "  # a space alone keeps its box
    assert "".join(render(shade([" a", " b"], [1.0, 2.0], peak=1)).itertext()).startswith(" a (m = +1) b")


def test_a_marked_trigger_leaves_its_leading_space_outside_too():
    """The same for the marked trigger of an unshaded prefix (the layer page; a key page while mining)."""
    from types import SimpleNamespace

    macro = templates.env.from_string('{% from "_macros.html" import prefix %}{{ prefix(t) }}')
    trigger = SimpleNamespace(prefix="The capital", trigger_start=3, position=1, trigger_token=" capital")
    assert macro.render(t=trigger) == (
        '<span class="prefix">The <mark class="trigger" title="trigger token at position 1">capital</mark>'
        "</span>"
    )
    alone = SimpleNamespace(prefix="a ", trigger_start=1, position=1, trigger_token=" ")
    assert '<mark class="trigger" title="trigger token at position 1"> </mark>' in macro.render(t=alone)


def test_a_token_without_a_coefficient_is_unshaded():
    root = render(shade(["a", "b"], [None, 3.0]))
    first, second = tokens(root)
    assert first.get("class") == "stok" and first.get("style") is None
    assert first.get("title") == "no coefficient" and first.get("data-m") is None
    assert second.get("style") == "--m: 1.000"


def test_token_pieces_put_together_are_the_text():
    """A space goes with the word after it; a BOS (no characters of its own) shows its text; the bytes of
    one split character after the first show nothing (the character is shown once)."""
    from bench.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for text in ["The capital 東京 é of France", " x  y\n z", "Paris."]:
        encoded = tokenizer(text, return_offsets_mapping=True)
        alone = [tokenizer.decode([i]) for i in encoded.input_ids]
        pieces = token_pieces(text, encoded.offset_mapping, alone)
        assert len(pieces) == len(alone) and "".join(pieces) == text
    assert token_pieces("東 a", [(0, 0), (0, 1), (0, 1), (0, 1), (1, 3)], ["<s>", "�", "�", "�", " a"]) == [
        "<s>",
        "東",
        "",
        "",
        " a",
    ]
    assert token_pieces("a  b", [(0, 1), (3, 4)], ["a", "b"]) == ["a", "  b"]  # a gap goes with the next
