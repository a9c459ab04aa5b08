"""Adapters that put zerda-cache under LLM frameworks.

- ``zerda_cache.integrations.langchain``: ``ZerdaLLMCache``, a LangChain ``BaseCache``
  (``set_llm_cache(ZerdaLLMCache(...))``); needs ``pip install 'zerda-cache[langchain]'``.
- ``zerda_cache.integrations.llamaindex``: ``ZerdaCachedLLM``, a LlamaIndex ``LLM`` that
  wraps another one; needs ``pip install 'zerda-cache[llamaindex]'``.

Each module imports its framework, so this package imports neither: import the module
you use. Both adapters share ``_binding.CacheBinding`` (the manager calls, fail-open and
feedback) and differ only in how they turn the framework's prompts and answers into a
query, a scope, a response text and metadata.
"""
