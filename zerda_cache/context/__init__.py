"""Companion modules from the seed's context engine page (``context-guard-and-learning``).

So far: ``ContextCache``, the local LRU+TTL cache that memoises embeddings per replica.
"""

from zerda_cache.context.cache import ContextCache

__all__ = ["ContextCache"]
