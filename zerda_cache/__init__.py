"""zerda-cache: a shared semantic cache for LLM apps that learns which answers to serve.

Every cached answer carries a Beta-Bernoulli bandit arm in Redis; feedback moves it, a
scheduled worker decays and evicts, and lookups rank candidates by similarity plus a
Thompson draw plus confidence.
"""

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.companions.prompt import PromptRequest, prompt_scope
from zerda_cache.core.config import CacheConfig, EvictionConfig, RLConfig
from zerda_cache.core.entry import BanditArm, IntelligentCacheEntry, LLMUsage
from zerda_cache.core.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    FencedError,
    InvalidEmbeddingError,
    InvalidEntryError,
    InvalidFeedbackError,
    InvalidSettingError,
    InvalidTenantError,
    StorageError,
    ZerdaError,
)
from zerda_cache.flows.verification import same_meaning, same_text
from zerda_cache.learning.bandit import CachePolicyLearner, EvictionCandidate, FeedbackSignal
from zerda_cache.manager import AdmissionCheck, CacheHit, CacheManager, Decision, PutResult
from zerda_cache.storage import AsyncRedisStorage, RedisStorage

__version__ = "0.2.0"

__all__ = [
    "AdmissionCheck",
    "AsyncCacheManager",
    "AsyncRedisStorage",
    "BanditArm",
    "CacheConfig",
    "CacheHit",
    "CacheManager",
    "CachePolicyLearner",
    "CorruptEntryError",
    "Decision",
    "DimensionMismatchError",
    "EntryNotFoundError",
    "EvictionCandidate",
    "EvictionConfig",
    "FeedbackSignal",
    "FencedError",
    "IntelligentCacheEntry",
    "InvalidEmbeddingError",
    "InvalidEntryError",
    "InvalidFeedbackError",
    "InvalidSettingError",
    "InvalidTenantError",
    "LLMUsage",
    "PromptRequest",
    "PutResult",
    "RLConfig",
    "RedisStorage",
    "StorageError",
    "ZerdaError",
    "__version__",
    "prompt_scope",
    "same_meaning",
    "same_text",
]
