"""Position information: sinusoidal tables, rotary embeddings (with context scaling), ALiBi.

* :func:`sinusoidal_positions` — Vaswani et al. 2017, §3.5: sin/cos interleaved, or in two
  halves (tensor2tensor / fairseq / Marian).
* :func:`apply_rope` — RoFormer (Su et al. 2021) rotary embeddings, half-split
  (GPT-NeoX / LLaMA, the default) or interleaved (GPT-J) pairing.
* :class:`RopeScaling` / :func:`rope_frequencies` — context extension:
  position interpolation (Chen et al. 2023), NTK-aware base change (bloc97 2023),
  Llama 3.1's wavelength-banded rescaling, and YaRN (Peng et al. 2023).
* :func:`alibi_slopes` / :func:`alibi_bias` — Press et al. 2022.

Frequencies are derived in float64 on the host (they depend only on static
arguments) and used in fp32; rotations are computed in fp32 whatever ``x.dtype``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from jaxformer.typing import ArrayLike

RopeKind = Literal["linear", "ntk", "llama3", "yarn"]
ROPE_KINDS = ("linear", "ntk", "llama3", "yarn")


SINUSOIDAL_LAYOUTS = ("interleaved", "halves")


def sinusoidal_positions(positions: Integer[ArrayLike, "*B"], dim: int, *,
                         layout: Literal["interleaved", "halves"] = "interleaved") -> Float[Array, "*B D"]:
    """Sinusoidal position table with frequencies ``w_i = 10000^(-2i/dim)``, ``i = 0 .. dim/2 - 1``.

    * ``layout="interleaved"`` (Vaswani et al. §3.5): ``pe[..., 2i] = sin(p w_i)``, ``pe[..., 2i+1] = cos(p w_i)``;
    * ``layout="halves"`` (tensor2tensor, fairseq, Marian): ``pe[..., i] = sin(p w_i)``,
      ``pe[..., dim/2 + i] = cos(p w_i)``.

    Args:
      positions: int array ``[...]`` (e.g. ``[T]`` or ``[B, T]``).
      dim: even model dimension D.
      layout: "interleaved" | "halves".
    Returns:
      float32 ``[..., dim]``.
    """
    if not isinstance(dim, (int, np.integer)) or dim <= 0 or dim % 2:
        raise ValueError(f"sinusoidal_positions needs a positive even dim, got {dim=}")
    if layout not in SINUSOIDAL_LAYOUTS:
        raise ValueError(f"sinusoidal_positions layout={layout!r} is not one of {SINUSOIDAL_LAYOUTS}")
    positions = jnp.asarray(positions)
    inv_freq = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = jnp.asarray(inv_freq, jnp.float32).reshape((1,) * positions.ndim + (dim // 2,))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    if layout == "halves":
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(positions.shape + (dim,))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE beyond the context it was trained on.

    ``factor`` s is the context-extension ratio. ``original_max_position`` L is the
    pre-training context (llama3, yarn). ``low_freq_factor`` / ``high_freq_factor``
    bound llama3's transition band; ``beta_slow`` / ``beta_fast`` (alpha / beta in
    the YaRN paper) bound YaRN's ramp, both in rotations over L.
    ``attention_factor`` overrides YaRN's ``0.1 * ln(s) + 1`` (yarn only).
    """

    kind: RopeKind
    factor: float
    original_max_position: int = 2048
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r} is not one of {ROPE_KINDS}")
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor={self.factor} must be >= 1")
        if not self.original_max_position > 0:
            raise ValueError(f"RopeScaling.original_max_position={self.original_max_position} must be > 0")
        if self.kind == "llama3" and not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling(kind='llama3') needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor=} {self.high_freq_factor=}"
            )
        if self.kind == "yarn" and not 0.0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                f"RopeScaling(kind='yarn') needs 0 < beta_slow < beta_fast, got "
                f"{self.beta_slow=} {self.beta_fast=}"
            )
        if self.attention_factor is not None:
            if self.kind != "yarn":
                raise ValueError(f"RopeScaling.attention_factor only applies to kind='yarn', got {self.kind=}")
            if not self.attention_factor > 0.0:
                raise ValueError(f"RopeScaling.attention_factor={self.attention_factor} must be > 0")


def _banded(inv_freq: np.ndarray, factor: float, context: int, lo: float, hi: float) -> np.ndarray:
    """Interpolate only slow dimensions: ``r = context / wavelength`` rotations over the context.

    ``r < lo``: divide by ``factor``; ``r > hi``: keep; linear ramp in ``r`` between.
    Llama 3.1 (lo, hi = low/high_freq_factor) and YaRN's NTK-by-parts (alpha, beta) share it.
    """
    r = context * inv_freq / (2.0 * math.pi)
    gamma = np.clip((r - lo) / (hi - lo), 0.0, 1.0)
    return (1.0 - gamma) * inv_freq / factor + gamma * inv_freq


def rope_frequencies(head_dim: int, *, base: float = 10000.0,
                     scaling: RopeScaling | None = None):
    """Rotary inverse frequencies ``theta_i = base^(-2i/H)``, ``i < H/2``, after scaling.

    * ``linear``: ``theta_i / s`` (position interpolation: position ``p`` acts as ``p / s``).
    * ``ntk``: base becomes ``base * s^(H / (H - 2))``, so the slowest pair is stretched
      by exactly ``s`` and the fastest is unchanged.
    * ``llama3``: pairs whose wavelength ``2 pi / theta_i`` exceeds ``L / low_freq_factor``
      get ``theta_i / s``, those shorter than ``L / high_freq_factor`` keep ``theta_i``,
      and between them ``(1 - g) theta_i / s + g theta_i`` with
      ``g = (L / wavelength - low) / (high - low)``.
    * ``yarn``: NTK-by-parts with ``r = L / wavelength``, ramp
      ``g = clip((r - beta_slow) / (beta_fast - beta_slow), 0, 1)`` (the paper's
      gamma, linear in ``r``), plus attention temperature ``sqrt(1/t) = 0.1 ln s + 1``.

    Returns:
      ``(inv_freq float32 [H/2], attention_factor)``. ``attention_factor`` is the
      factor :func:`apply_rope` multiplies *each* of q and k by, so logits scale by
      its square, ``1/t``; it is 1.0 except for YaRN.
    """
    if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs a positive even head dim, got {head_dim=}")
    if not base > 1.0:
        raise ValueError(f"RoPE base must be > 1, got {base=}")
    H = int(head_dim)
    exponent = np.arange(0, H, 2, dtype=np.float64) / H
    inv_freq = base ** -exponent
    attention_factor = 1.0
    if scaling is not None:
        s = float(scaling.factor)
        L = scaling.original_max_position
        if scaling.kind == "linear":
            inv_freq = inv_freq / s
        elif scaling.kind == "ntk":
            if H <= 2:
                raise ValueError(f"NTK-aware RoPE scaling needs head dim > 2, got {head_dim=}")
            inv_freq = (base * s ** (H / (H - 2))) ** -exponent
        elif scaling.kind == "llama3":
            inv_freq = _banded(inv_freq, s, L, scaling.low_freq_factor, scaling.high_freq_factor)
        else:
            inv_freq = _banded(inv_freq, s, L, scaling.beta_slow, scaling.beta_fast)
            attention_factor = (0.1 * math.log(s) + 1.0 if scaling.attention_factor is None
                                else float(scaling.attention_factor))
    return jnp.asarray(inv_freq, jnp.float32), attention_factor


def _unfusable_copy(t: Float[Array, "*B K"]) -> Float[Array, "*B K"]:
    """``t`` itself, as the product ``t @ I``: exact for the finite, normal values RoPE's tables hold (each entry
    times 1 plus zeros; ``precision=HIGHEST``), and a product, which XLA's CPU backend does not fuse into a loop.

    Left to fuse, that backend folds RoPE's ``cos`` / ``sin`` tables ``[..., T, 1, H/2]`` into the rotation they
    feed (the gradient's, in every layer) and evaluates them for every element it writes, ``[..., T, N, H]``: 2N
    times the transcendentals. ``optimization_barrier`` does not stop it (the CPU pipeline removes barriers before
    fusing); the product does (``experiments/results/train_throughput.md``, "RoPE's tables computed once").
    """
    return jnp.matmul(t, jnp.eye(t.shape[-1], dtype=t.dtype), precision=jax.lax.Precision.HIGHEST)


def apply_rope(x: Float[ArrayLike, "*B T N H"], positions: Integer[ArrayLike, "*#B T"], *, base: float = 10000.0,
               scaling: RopeScaling | None = None, interleaved: bool = False) -> Float[Array, "*B T N H"]:
    """Rotate each pair of ``x``'s head dim by ``position * theta_i``.

    Args:
      x: ``[B, T, N, H]`` (any leading dims ``[..., T, N, H]``); q or k.
      positions: int ``[T]`` or ``[B, T]``; its shape must equal the trailing dims of
        ``x.shape[:-2]`` (size-1 dims broadcast).
      base: RoPE base (10000 in RoFormer, 500000 in Llama 3).
      scaling: optional :class:`RopeScaling`.
      interleaved: pair ``(2i, 2i+1)`` as in GPT-J; default pairs ``(i, i + H/2)``
        (``rotate_half``, GPT-NeoX / LLaMA). The two are the same rotation up to a
        permutation of the head dim.

    Returns:
      Same shape and dtype as ``x``, computed in fp32. With YaRN the result is also
      multiplied by ``attention_factor`` (``0.1 ln s + 1`` by default). Apply this to
      both q and k: logits then scale by ``attention_factor**2 = 1/t`` as in the paper.
    """
    x = jnp.asarray(x)
    positions = jnp.asarray(positions)
    if x.ndim < 3:
        raise ValueError(f"apply_rope expects x [..., T, N, H]; got {x.shape=}")
    H = x.shape[-1]
    if H % 2:
        raise ValueError(f"apply_rope needs an even head dim; got {x.shape=} with H={H}")
    lead = x.shape[:-2]
    p = positions.shape
    if not (1 <= len(p) <= len(lead) and p[-1] == lead[-1]
            and all(a in (1, b) for a, b in zip(p, lead[-len(p):]))):
        raise ValueError(
            f"apply_rope: positions must be [T] or [B, T] matching x [..., T, N, H]; "
            f"got {x.shape=} {positions.shape=}"
        )
    inv_freq, attention_factor = rope_frequencies(H, base=base, scaling=scaling)
    pos = positions.astype(jnp.float32).reshape((1,) * (len(lead) - len(p)) + p)
    angles = pos[..., None, None] * inv_freq.reshape((1,) * (len(lead) + 1) + (H // 2,))  # [..., T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    # the copies on the CPU only (decided where the program is lowered); other backends take the tables as they are
    cos, sin = jax.lax.platform_dependent(cos, sin, cpu=lambda c, s: (_unfusable_copy(c), _unfusable_copy(s)),
                                          default=lambda c, s: (c, s))
    xf = x.astype(jnp.float32)
    if interleaved:
        pairs = xf.reshape(x.shape[:-1] + (H // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = xf[..., : H // 2], xf[..., H // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> Float[Array, "N"]:
    """ALiBi head slopes, float32 ``[N]``.

    For ``N`` a power of two: the geometric sequence ``2^(-8 i / N)``, ``i = 1..N``
    (8 heads: 1/2, 1/4, ..., 1/256). Otherwise, as in the paper: the slopes of the
    closest smaller power of two ``n``, followed by every other slope of the ``2n``
    sequence (its odd-indexed terms 1st, 3rd, ...) until there are ``N``.
    """
    if not isinstance(num_heads, (int, np.integer)) or num_heads <= 0:
        raise ValueError(f"alibi_slopes needs a positive int number of heads, got {num_heads=}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(n) + geometric(2 * n)[0::2][: num_heads - n]
    return jnp.asarray(np.asarray(slopes, np.float64), jnp.float32)


def alibi_bias(slopes: Float[ArrayLike, "N"], q_positions: Integer[ArrayLike, "T"],
               k_positions: Integer[ArrayLike, "S"]) -> Float[Array, "N T S"]:
    """``bias[n, t, s] = -slopes[n] * |q_positions[t] - k_positions[s]|``, float32 ``[N, T, S]``."""
    slopes = jnp.asarray(slopes)
    q_positions = jnp.asarray(q_positions)
    k_positions = jnp.asarray(k_positions)
    if slopes.ndim != 1 or q_positions.ndim != 1 or k_positions.ndim != 1:
        raise ValueError(
            f"alibi_bias expects slopes [N], q_positions [T], k_positions [S]; got "
            f"{slopes.shape=} {q_positions.shape=} {k_positions.shape=}"
        )
    dist = jnp.abs(q_positions[:, None] - k_positions[None, :]).astype(jnp.float32)
    return -slopes.astype(jnp.float32)[:, None, None] * dist[None, :, :]
