"""The text features of a match: a question's sketch (numbers, names, negation) and the
differences between two, the same in Python (``learning/text_match.py``) and in the hit
script's Lua (``zc_text_combo`` in ``storage/lua/_lib.lua``)."""

from __future__ import annotations

import itertools
import random

import pytest
import redis

from zerda_cache.learning.match_model import text_known
from zerda_cache.learning.text_match import (
    ALL,
    bits_of,
    combo,
    differences,
    sketch,
)
from zerda_cache.storage.scripts import script_source

QUESTIONS = [
    "What is the price of the iPhone 14?",
    "What is the price of the iPhone 15?",
    "What's the price of an iPhone 14 in India?",
    "Can I take ibuprofen with paracetamol?",
    "Can I not take ibuprofen with paracetamol?",
    "Why can't I sleep at night?",
    "Why can\u2019t I sleep at night?",
    "Why do I sleep at night?",
    "How do I learn Python? Is Java easier?",
    "How do I learn python? is java easier?",
    "Who is Donald Trump's wife?",
    "Who is Barack Obama's wife?",
    "I'm new to Quora. How do I ask a question?",
    "What is 1,000 times 3.5?",
    "What is 1000 times 3.5?",
    "Is it safe?   Really safe!  Yes",
    "Naïve Bayes vs SVM: which is better for NLP?",
    "Where can I buy a Galaxy S7 edge in Mumbai...",
    "",
    "   ",
    "2016 vs 2017: which year had more Oscars?",
    "He never said no to nobody",
    "Isn't it NOT true?",
    "'Quoted' Words and (Brackets) Here",
    "tabs\tand\nnew lines. New Sentence\vVertical",
    "emoji \U0001f600 Then Caps",
]


def test_sketch_parts() -> None:
    assert sketch("What is the price of the iPhone 14?") == "14||0"
    assert sketch("Who is Donald Trump's wife?") == "|donald,trump's|0"
    # a sentence's first word is no name, nor is "I"
    assert sketch("How do I learn Python? Is Java easier?") == "|java,python|0"
    assert sketch("Why can\u2019t I sleep?") == sketch("Why can't I sleep?") == "||1"
    assert sketch("What is 1,000 times 3.5?") == "000,1,3,5||0"
    assert sketch("") == "||0"


def test_differences_and_combos() -> None:
    a = sketch("What is the price of the iPhone 14?")
    b = sketch("What is the price of the iPhone 15?")
    assert differences(a, b) == (1.0, 0.0, 0.0)
    assert differences(a, a) == (0.0, 0.0, 0.0)
    neg = sketch("Can I not take ibuprofen with Tylenol?")
    pos = sketch("Can I take ibuprofen with Advil?")
    assert differences(neg, pos) == (0.0, 1.0, 1.0)
    for i in range(8):
        assert combo(bits_of(i)) == i
    assert text_known((0.9, 0.1, 0.0, 1.0, 0.0, 0.0))
    assert not text_known((0.9, 0.1, 0.0, float("nan"), float("nan"), float("nan")))
    assert not text_known((0.9, 0.1, 0.0))
    assert len(ALL) == 8


def _lua_combos(client: redis.Redis, pairs: list[tuple[str, str]]) -> list[int]:
    body = script_source("hit").split("local now = zc_now", 1)[0]
    script = body + (
        "\nlocal out = {}\nfor i = 1, #ARGV, 2 do\n"
        "  out[#out + 1] = zc_text_combo(ARGV[i], ARGV[i + 1])\nend\nreturn out\n"
    )
    if script.startswith("#!lua"):
        script = script.split("\n", 1)[1]
    args = [x for a, b in pairs for x in (sketch(a), b)]
    return [int(x) for x in client.eval(script, 0, *args)]


def test_lua_agrees_with_python(redis_client: redis.Redis) -> None:
    pairs = list(itertools.product(QUESTIONS, QUESTIONS))
    rng = random.Random(7)
    alphabet = "aB3 '.?!,\u2019\t\nIXn'tnotNo9é"
    for _ in range(400):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        pairs.append((a, b))
    expected = [combo(differences(sketch(a), sketch(b))) for a, b in pairs]
    assert _lua_combos(redis_client, pairs) == expected


def test_lua_reads_a_malformed_sketch_as_all_different(redis_client: redis.Redis) -> None:
    body = script_source("hit").split("local now = zc_now", 1)[0].split("\n", 1)[1]
    got = redis_client.eval(body + "\nreturn zc_text_combo(ARGV[1], ARGV[2])", 0, "nope", "x")
    assert got == 7


@pytest.mark.parametrize("text", QUESTIONS)
def test_sketch_is_one_line_of_three_parts(text: str) -> None:
    parts = sketch(text).split("|")
    assert len(parts) == 3 and parts[2] in ("0", "1")
