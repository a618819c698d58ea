"""jaxformer.decode: KV caches (contiguous and paged), sampling, generation and the batching engine."""

from jaxformer.decode.engine import Engine, Result, serve
from jaxformer.decode.generate import generate
from jaxformer.decode.kv_cache import KVCache, init_caches, set_lengths
from jaxformer.decode.paged import BlockManager, OutOfPages, PagedKVCache, copy_pages, init_page_pools
from jaxformer.decode.sampling import SamplingParams, sample

__all__ = [
    "BlockManager", "Engine", "KVCache", "OutOfPages", "PagedKVCache", "Result", "SamplingParams",
    "copy_pages", "generate", "init_caches", "init_page_pools", "sample", "serve", "set_lengths",
]
