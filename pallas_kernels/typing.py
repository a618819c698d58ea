"""The shape alphabet as jaxtyping aliases: jax, numpy and jaxtyping only (``jaxformer.typing`` re-exports them).

One letter, one meaning, in annotations and einsum strings alike:

B batch · T query length · S key/value length · N query heads · K kv heads (N % K == 0) ·
G = N // K query heads per kv head · H head dim · D model dim · F ffn hidden · V vocab ·
P pages · L page size (tokens per page) · M max pages per sequence.

Letters used only inside a path's einsums (block-sparse attention, split-K decode):

Q query blocks (``ceil(T / C)``) · C block size (queries, and keys, per block) ·
W keys gathered per query block (its kv block list's width times C) ·
E global query rows (queries that see every key) · Z splits of a sequence's pages (split-K decode).

Activations are ``[B, T, D]``; attention inputs ``q [B, T, N, H]`` and ``k, v [B, S, K, H]``
(the layout of ``jax.nn.dot_product_attention``), e.g. ``"BTKGH,BSKH->BKGTS"``.

Annotations name what a public function accepts: a ``jax.Array`` (tracers included, so they hold
under ``jit``, ``grad`` and ``vmap``) or a ``numpy`` array, of a dtype kind (``Float``: bf16 / fp16 /
fp32 / fp64; ``Integer``: signed or unsigned ints). ``*B`` is any number of leading dims and ``#B``
a dim that may also be 1 (broadcast). Nothing checks them in the library itself; the test suite
checks every call at runtime (``tests/conftest.py``: jaxtyping's import hook with beartype).
"""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import Array, Float, Integer, Key, UInt32

# One meaning per letter; tests/test_typing.py checks every einsum string of the library against it.
LETTERS = {
    "B": "batch", "T": "query length", "S": "key/value length", "N": "query heads", "K": "kv heads",
    "G": "query heads per kv head (N // K)", "H": "head dim", "D": "model dim", "F": "ffn hidden",
    "V": "vocab", "P": "pages", "L": "page size (tokens per page)", "M": "max pages per sequence",
    # inside a path's einsums only
    "Q": "query blocks", "C": "block size (queries, and keys, per block)",
    "W": "keys gathered per query block", "E": "global query rows", "Z": "splits of a sequence's pages",
}

ArrayLike = jax.Array | np.ndarray  # what public functions accept; they return jax.Array

# Attention (flash_attention, dot_product_attention and friends).
Query = Float[ArrayLike, "B T N H"]
KeyValue = Float[ArrayLike, "B S K H"]
AttnOut = Float[Array, "B T N H"]
SegmentIds = Integer[ArrayLike, "B T"]
KvSegmentIds = Integer[ArrayLike, "B S"]
Lengths = Integer[ArrayLike, "B"]
Slopes = Float[ArrayLike, "N"] | Float[ArrayLike, "B N"]  # ALiBi: one slope per query head
RowLse = Float[Array, "B N T"]

# Paged decode (paged_attention).
DecodeQuery = Float[ArrayLike, "B N H"]
DecodeOut = Float[Array, "B N H"]
Pages = Float[ArrayLike, "K P L H"]
BlockTables = Integer[ArrayLike, "B M"]

# Random keys: a typed key (jax.random.key) or a raw uint32 pair (jax.random.PRNGKey).
PRNGKey = Key[Array, ""] | UInt32[Array, "2"]

__all__ = [
    "LETTERS", "ArrayLike", "AttnOut", "BlockTables", "DecodeOut", "DecodeQuery", "KeyValue", "KvSegmentIds",
    "Lengths", "PRNGKey", "Pages", "Query", "RowLse", "SegmentIds", "Slopes",
]
