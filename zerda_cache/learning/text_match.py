"""What a question's text says that its embedding blurs: the numbers in it, the names it
capitalises and whether it negates. Two questions a sentence embedding puts close
together ("price of the iPhone 14" / "price of the iPhone 15", "can I take ibuprofen
with ..." / "can I not take ...") differ in exactly these; the match model
(``match_model.py``) weighs each difference as a feature of the match beside
similarity, gap and crowding.

A question's ``sketch`` is three parts, joined into one line of text so that a lookup
can hand it to the hit script (``hit.lua``), which computes the cached question's
sketch from the entry's stored question the same way (``zc_text_sketch`` in
``lua/_lib.lua``) and serves it only if their differences are ones the bound allows
(``text_mask``). Both sides follow the same rules, on ASCII only, so that they agree
byte for byte (tests/test_text_match.py holds them equal):

- tokens are the maximal runs of ``[A-Za-z0-9']`` (a right single quote counts as an
  apostrophe); anything else, any non-ASCII letter included, separates them;
- ``numbers``: the maximal runs of digits, as a set;
- ``names``: the tokens, lowercased, that start with a capital and do not start a
  sentence (the first token, or one after ``.``, ``?`` or ``!`` and blanks), other than
  ``I`` and its contractions, as a set;
- ``negation``: whether a token, lowercased, is a negation word (``NEGATIONS``) or ends
  in ``n't``.

The three differences of a match (``differences``) are 1.0 where the two sets (or
flags) differ, 0.0 where they agree, as the features ``numbers``, ``names`` and
``negation`` of the match model; a match whose candidate's text is not known at lookup
is scored with them unknown (NaN: each weighs its mean).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Words that negate a question (tokens ending in "n't" do too).
NEGATIONS = frozenset(
    ["not", "no", "never", "without", "cannot", "nor", "neither", "none", "nothing", "nobody"]
)
#: The differences, in the order of the match model's text features.
TEXT_FEATURES = ("numbers", "names", "negation")
#: The combinations of differences (bit 0 numbers, bit 1 names, bit 2 negation).
COMBOS = 1 << len(TEXT_FEATURES)
#: A mask that lets every combination through: no guard.
ALL = "1" * COMBOS
NONE = "0" * COMBOS

_TOKEN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789'")
_DIGITS = frozenset("0123456789")
_CAPITALS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_BLANKS = frozenset(" \t\n\r\f\v")
_ENDS = frozenset(".?!")


def _runs(text: str, chars: frozenset[str]) -> list[tuple[int, str]]:
    """The maximal runs of ``chars`` in ``text``, with their start offsets."""
    out: list[tuple[int, str]] = []
    start = -1
    for i, c in enumerate(text):
        if c in chars:
            if start < 0:
                start = i
        elif start >= 0:
            out.append((start, text[start:i]))
            start = -1
    if start >= 0:
        out.append((start, text[start:]))
    return out


def _starts_sentence(text: str, at: int) -> bool:
    i = at - 1
    while i >= 0 and text[i] in _BLANKS:
        i -= 1
    return i < 0 or text[i] in _ENDS


def sketch(text: str) -> str:
    """The sketch of a question: ``numbers|names|negation``, each set sorted and
    comma-joined, the flag ``1`` or ``0`` (see the module's docstring)."""
    text = text.replace("\u2019", "'")
    numbers: set[str] = set()
    names: set[str] = set()
    negation = False
    for at, tok in _runs(text, _TOKEN):
        numbers.update(run for _, run in _runs(tok, _DIGITS))
        low = tok.lower()
        if low in NEGATIONS or low.endswith("n't"):
            negation = True
        if (
            tok[0] in _CAPITALS
            and tok != "I"
            and not tok.startswith("I'")
            and not _starts_sentence(text, at)
        ):
            names.add(low)
    return "|".join([",".join(sorted(numbers)), ",".join(sorted(names)), "1" if negation else "0"])


def differences(a: str, b: str) -> tuple[float, float, float]:
    """The text features of a match between two sketches: 1.0 per part that differs."""
    pa, pb = a.split("|"), b.split("|")
    return (float(pa[0] != pb[0]), float(pa[1] != pb[1]), float(pa[2] != pb[2]))


def combo(bits: Sequence[float]) -> int:
    """The index of a combination of differences (``differences``) in a mask."""
    return sum(1 << i for i, b in enumerate(bits) if b)


def bits_of(index: int) -> tuple[float, float, float]:
    """The differences of combination ``index`` (``combo``'s inverse)."""
    return (float(index & 1), float(index >> 1 & 1), float(index >> 2 & 1))


__all__ = [
    "ALL",
    "COMBOS",
    "NEGATIONS",
    "NONE",
    "TEXT_FEATURES",
    "bits_of",
    "combo",
    "differences",
    "sketch",
]
