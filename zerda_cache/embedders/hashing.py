"""``HashingEmbedder``: no model and no download. It hashes words and character trigrams
into a fixed number of dimensions (signed feature hashing) and L2-normalises. Two questions
sharing words and word pieces get a high cosine similarity; paraphrases that share no words
do not. It measures lexical overlap, not meaning, so it makes mistakes a sentence-embedding
model would not: which is fine for showing how feedback corrects what similarity alone gets
wrong.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

_WORD = re.compile(r"\w+")
#: Words too common in questions to say anything about the topic.
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "can",
        "could",
        "do",
        "does",
        "for",
        "from",
        "how",
        "i",
        "in",
        "is",
        "it",
        "me",
        "my",
        "of",
        "on",
        "or",
        "the",
        "there",
        "this",
        "to",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "will",
        "with",
        "you",
        "your",
    ]
)


class HashingEmbedder:
    """Signed feature hashing of words (weight 1) and their trigrams (weight 0.5).

    Args:
        dim: output dimension.
        salt: changes the hash functions (so two embedders can disagree on purpose).
    """

    def __init__(self, dim: int = 256, salt: str = "zerda") -> None:
        if dim < 8:
            raise ValueError(f"dim must be >= 8, got {dim}")
        self.dim = dim
        self.salt = salt.encode()

    def _slot(self, feature: str) -> tuple[int, float]:
        h = hashlib.blake2b(feature.encode(), digest_size=8, key=self.salt).digest()
        value = int.from_bytes(h, "little")
        return value % self.dim, 1.0 if (value >> 63) & 1 else -1.0

    def __call__(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float64)
        words = [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]
        for word in words:
            slot, sign = self._slot("w:" + word)
            vec[slot] += sign
            padded = f"^{word}$"
            for i in range(len(padded) - 2):
                slot, sign = self._slot("t:" + padded[i : i + 3])
                vec[slot] += 0.5 * sign
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:  # nothing but stopwords: a fixed direction of its own
            slot, sign = self._slot("empty")
            vec[slot] = sign
            norm = 1.0
        return (vec / norm).astype(np.float32)
