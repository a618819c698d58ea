"""The math of one ``[bq, bk]`` tile, shared by the GPU and TPU flash kernels (pure jnp).

Logit order, per tile: ``s = scale * q·k`` (fp32) -> ``softcap * tanh(s / softcap)`` ->
``- slope * |q_pos - k_pos|`` (ALiBi) -> mask (``KernelMask.allowed``) -> online softmax.

A row with no allowed key has output 0 and stores ``lse = EMPTY_ROW_LSE`` (``+inf``), so
``exp(s - lse) == 0`` in the backward pass and its gradients are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

EMPTY_ROW_LSE = float("inf")


@dataclasses.dataclass(frozen=True)
class Logits:
    """How the kernels form logits: static ``scale`` and ``softcap`` plus the ALiBi slopes operand.

    ``alibi_slopes`` fp32 ``[1|B, N]`` or None is the pytree's one leaf; :meth:`static` drops it
    (keeping whether it is there) for a hashable view. ``scale`` None means ``1/sqrt(H)``
    (:func:`~pallas_kernels.flash_attention.checks.check_logits` resolves it).
    """

    scale: float | None = None
    softcap: float | None = None
    alibi_slopes: Any = None

    def static(self) -> "Logits":
        return dataclasses.replace(self, alibi_slopes=None if self.alibi_slopes is None
                                   else tuple(jnp.shape(self.alibi_slopes)))

    def tile(self, qk, q_pos=None, k_pos=None, slope=None):
        """``qk`` fp32 raw ``q·k`` tile -> (logits before masking, d logits / d qk).

        The derivative is ``scale`` (a Python float) without softcap, else the tile
        ``scale * (1 - tanh(s/softcap)^2)``. ALiBi needs ``q_pos``, ``k_pos`` and the loaded ``slope``.
        """
        s = qk * self.scale
        dscale: Any = self.scale
        if self.softcap is not None:
            t = jnp.tanh(s / self.softcap)
            s = self.softcap * t
            dscale = self.scale * (1.0 - t * t)
        if slope is not None:
            s = s + alibi_tile(slope, q_pos, k_pos)
        return s, dscale


jax.tree_util.register_dataclass(Logits, data_fields=["alibi_slopes"], meta_fields=["scale", "softcap"])


def alibi_tile(slope, q_pos, k_pos):
    """ALiBi bias tile ``-slope * |q_pos - k_pos|`` in fp32 (slope a scalar)."""
    return -jnp.asarray(slope, jnp.float32) * jnp.abs(q_pos - k_pos).astype(jnp.float32)


def mask_logits(s, allowed):
    return s if allowed is None else jnp.where(allowed, s, -jnp.inf)


def safe_max(m):
    """A running max with -inf (empty so far) replaced by 0, so ``exp(s - m)`` never sees inf - inf."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def finalize_lse(m, l):
    """Row log-sum-exp from running max ``m`` and sum ``l``; empty rows get ``EMPTY_ROW_LSE``."""
    return jnp.where(l == 0.0, EMPTY_ROW_LSE, safe_max(m) + jnp.log(jnp.where(l == 0.0, 1.0, l)))


def pattern_terms(k_pos, *, q_glob=None, kv_glob=None, rand_starts=(), rand_size: int = 1) -> dict:
    """The mask rule's pattern keywords of a tile from the kernel operands: ``q_glob`` ``[bq, 1]``,
    ``kv_glob`` ``[1, bk]`` (nonzero = global), ``rand_starts`` a sequence of ``[bq, 1]`` int32 block
    starts (-1 none). Absent terms are None."""
    random = None
    for st in rand_starts:
        hit = (st >= 0) & (k_pos >= st) & (k_pos < st + rand_size)
        random = hit if random is None else random | hit
    return {"q_global": None if q_glob is None else q_glob != 0,
            "kv_global": None if kv_glob is None else kv_glob != 0, "random": random}
