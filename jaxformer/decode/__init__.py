"""jaxformer.decode: KV caches (contiguous and paged), sampling, generation and the batching engine.

``serve`` here is the function (:func:`jaxformer.decode.engine.serve`); text prompts in, JSON records out
is the module :mod:`jaxformer.decode.prompts`."""

from jaxformer.decode.block_manager import BlockManager, OutOfPages
from jaxformer.decode.engine import Engine, EngineOptions, Result, serve
from jaxformer.decode.generate import generate
from jaxformer.decode.kv_cache import KVCache, init_caches, set_lengths
from jaxformer.decode.paged_cache import PagedKVCache, copy_pages, init_page_pools
from jaxformer.decode.sampling import SamplingParams, sample
from jaxformer.decode.translate import TranslationConfig, beam_translate, greedy_translate

__all__ = [
    "BlockManager", "Engine", "EngineOptions", "KVCache", "OutOfPages", "PagedKVCache", "Result", "SamplingParams",
    "TranslationConfig", "beam_translate", "copy_pages", "generate", "greedy_translate", "init_caches",
    "init_page_pools", "sample", "serve", "set_lengths",
]
