# ruff: noqa: RUF001 - Turkish words: their dotless i is a letter, not a confusable
"""``RuleBasedQueryAnalyzer``: a small, documented rule set that classifies a query.

The seed names the analyzer (its ``context_budget`` is the adaptive system's base budget)
but does not give its rules; these are ours:

1. Words are the whitespace-separated tokens of the query; a token is lower-cased and
   stripped of surrounding punctuation before it is compared with the word lists below.
2. ``is_question``: the query ends with ``?`` or its first word is a question word
   (English or Turkish, see :data:`QUESTION_WORDS`).
3. Reasoning cues are the words of :data:`REASONING_CUES` ("why", "how", "compare", ...).
4. Complexity:

   - ``HIGH`` if there are more than 20 words, or a reasoning cue with at least 12 words,
     or more than one ``?``;
   - else ``MEDIUM`` if there are at least 8 words or any reasoning cue;
   - else ``LOW``.

5. ``context_budget`` is the config's budget for that complexity
   (:meth:`ContextEngineConfig.budget_for`).
"""

from __future__ import annotations

from zerda_cache.companions.context.types import ContextEngineConfig, QueryAnalysis, QueryComplexity

#: First words that make a query a question (English and Turkish).
QUESTION_WORDS = frozenset(
    {
        "what", "why", "how", "when", "where", "who", "whom", "whose", "which",
        "is", "are", "can", "could", "do", "does", "did", "should", "would", "will",
        "ne", "neden", "niçin", "niye", "nasıl", "nerede", "nereye", "kim",
        "hangi", "kaç",
    }
)  # fmt: skip

#: Words that signal a query needing reasoning rather than a lookup.
REASONING_CUES = frozenset(
    {
        "why", "how", "compare", "comparison", "explain", "analyze", "analyse", "evaluate",
        "difference", "differences", "versus", "vs", "tradeoff", "tradeoffs", "trade-off",
        "trade-offs", "pros", "cons",
        "neden", "nasıl", "karşılaştır", "açıkla", "fark", "farkı", "farklar", "analiz",
    }
)  # fmt: skip

_PUNCTUATION = "?!.,;:\"'()[]{}"

HIGH_WORDS = 20
HIGH_WORDS_WITH_CUE = 12
MEDIUM_WORDS = 8


class RuleBasedQueryAnalyzer:
    """Classifies queries by length, question marks and reasoning cue words.

    Args:
        config: where the per-complexity budgets come from (default: a fresh
            :class:`ContextEngineConfig`).
    """

    def __init__(self, config: ContextEngineConfig | None = None) -> None:
        self.config = config if config is not None else ContextEngineConfig()

    def analyze(self, query: str) -> QueryAnalysis:
        """Classify ``query`` by the rules in this module's docstring.

        Args:
            query: the user's query.

        Returns:
            Its :class:`QueryAnalysis`.
        """
        words = [w.strip(_PUNCTUATION).lower() for w in query.split()]
        words = [w for w in words if w]
        n = len(words)
        cues = tuple(dict.fromkeys(w for w in words if w in REASONING_CUES))
        is_question = query.rstrip().endswith("?") or (n > 0 and words[0] in QUESTION_WORDS)
        if n > HIGH_WORDS or (cues and n >= HIGH_WORDS_WITH_CUE) or query.count("?") > 1:
            complexity = QueryComplexity.HIGH
        elif n >= MEDIUM_WORDS or cues:
            complexity = QueryComplexity.MEDIUM
        else:
            complexity = QueryComplexity.LOW
        return QueryAnalysis(
            query=query,
            complexity=complexity,
            context_budget=self.config.budget_for(complexity),
            word_count=n,
            is_question=is_question,
            reasoning_cues=cues,
        )


__all__ = ["QUESTION_WORDS", "REASONING_CUES", "RuleBasedQueryAnalyzer"]
