"""The shape alphabet, declared once: the kernels' aliases (``pallas_kernels.typing``) plus the model's.

B batch · T query length · S key/value length · N query heads · K kv heads
(N % K == 0; G = N // K) · H head dim · D model dim · F ffn hidden · V vocab
· P pages · L page size (tokens per page) · M max pages per sequence.

Letters used only inside a path's einsums: Q query blocks · C block size ·
W keys gathered per query block · E global query rows · Z splits of a
sequence's pages (see ``pallas_kernels.typing``).

Activations are ``[B, T, D]``; attention inputs ``q [B, T, N, H]`` and
``k, v [B, S, K, H]`` (the layout of ``jax.nn.dot_product_attention``).
Einsum strings use the same letters, e.g. ``"BTKGH,BSKH->BKGTS"``. The
kernels declare the aliases they need themselves (they never import
``jaxformer``); everything model-side is added here.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Integer

from pallas_kernels.typing import (
    LETTERS,
    ArrayLike,
    AttnOut,
    BlockTables,
    DecodeOut,
    DecodeQuery,
    KeyValue,
    KvSegmentIds,
    Lengths,
    Pages,
    PRNGKey,
    Query,
    RowLse,
    SegmentIds,
    Slopes,
)

Activations = Float[ArrayLike, "B T D"]
Memory = Float[ArrayLike, "B S D"]  # the encoder output a decoder cross-attends to
Logits = Float[Array, "B T V"]
Tokens = Integer[ArrayLike, "B T"]
SourceTokens = Integer[ArrayLike, "B S"]  # an encoder's input: the keys its decoder attends to
Positions = Integer[ArrayLike, "B T"] | Integer[ArrayLike, "T"]
KvPositions = Integer[ArrayLike, "B S"] | Integer[ArrayLike, "S"]
DenseMask = Bool[Array, "#B T S"]
# Transformer.__call__ / apply: the source tokens [B, S] of an encoder-decoder, else the tokens [B, T]
# (encode and decode check the lengths against each other).
AnyTokens = Integer[ArrayLike, "B _"]
AnyPositions = Integer[ArrayLike, "B _"] | Integer[ArrayLike, "_"]

__all__ = [
    "LETTERS", "Activations", "AnyPositions", "AnyTokens", "ArrayLike", "AttnOut", "BlockTables", "DecodeOut",
    "DecodeQuery", "DenseMask", "KeyValue", "KvPositions", "KvSegmentIds", "Lengths", "Logits", "Memory", "PRNGKey",
    "Pages", "Positions", "Query", "RowLse", "SegmentIds", "Slopes", "SourceTokens", "Tokens",
]
