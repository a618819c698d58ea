"""The shape alphabet, declared once.

B batch · T query length · S key/value length · N query heads · K kv heads
(N % K == 0; G = N // K) · H head dim · D model dim · F ffn hidden · V vocab
· P pages · L page size (tokens per page) · M max pages per sequence.

Activations are ``[B, T, D]``; attention inputs ``q [B, T, N, H]`` and
``k, v [B, S, K, H]`` (the layout of ``jax.nn.dot_product_attention``).
Einsum strings use the same letters, e.g. ``"BTKGH,BSKH->BKGTS"``.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int

Activations = Float[Array, "B T D"]
Query = Float[Array, "B T N H"]
KeyValue = Float[Array, "B S K H"]
AttnOut = Float[Array, "B T N H"]
Logits = Float[Array, "B T V"]
Tokens = Int[Array, "B T"]
SegmentIds = Int[Array, "B T"]
KvSegmentIds = Int[Array, "B S"]
Lengths = Int[Array, "B"]
DenseMask = Bool[Array, "*B T S"]
Positions = Int[Array, "*B T"]
DecodeQuery = Float[Array, "B N H"]
Pages = Float[Array, "K P L H"]
BlockTables = Int[Array, "B M"]

__all__ = [
    "Activations", "Query", "KeyValue", "AttnOut", "Logits", "Tokens", "SegmentIds",
    "KvSegmentIds", "Lengths", "DenseMask", "Positions", "DecodeQuery", "Pages", "BlockTables",
]
