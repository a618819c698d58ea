"""Positional encodings vs float64 references written from the papers' formulas."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxformer.ops import (
    MaskSpec,
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    dot_product_attention,
    rope_frequencies,
    sinusoidal_positions,
)

# ---------------------------------------------------------------- sinusoidal


def test_sinusoidal_matches_paper_loop():
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 1000, size=(2, 7))
    dim = 16
    ref = np.zeros(positions.shape + (dim,))
    for idx in np.ndindex(positions.shape):
        p = float(positions[idx])
        for i in range(dim // 2):
            ref[idx + (2 * i,)] = math.sin(p / 10000 ** (2 * i / dim))
            ref[idx + (2 * i + 1,)] = math.cos(p / 10000 ** (2 * i / dim))
    out = sinusoidal_positions(jnp.asarray(positions), dim)
    assert out.dtype == jnp.float32 and out.shape == (2, 7, dim)
    # fp32 angle p * w for p < 1000 carries ~1000 * 6e-8 rad of rounding error.
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(sinusoidal_positions(jnp.zeros(1, jnp.int32), 4)), [[0, 1, 0, 1]])


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_sinusoidal_layouts_match_numpy_float64(layout):
    """Both layouts from one float64 table of sin(p w_i), cos(p w_i), w_i = 10000^(-2i/D): interleaved puts
    the pair at (2i, 2i+1) (Vaswani), halves at (i, D/2 + i) (tensor2tensor / fairseq / Marian)."""
    positions = np.random.default_rng(1).integers(0, 600, size=(3, 5))
    dim = 12
    w = 10000.0 ** (-2.0 * np.arange(dim // 2) / dim)
    angle = positions[..., None].astype(np.float64) * w  # [3, 5, D/2]
    ref = np.zeros(positions.shape + (dim,))
    if layout == "interleaved":
        ref[..., 0::2], ref[..., 1::2] = np.sin(angle), np.cos(angle)
    else:
        ref[..., : dim // 2], ref[..., dim // 2:] = np.sin(angle), np.cos(angle)
    out = sinusoidal_positions(jnp.asarray(positions), dim, layout=layout)
    assert out.dtype == jnp.float32 and out.shape == (3, 5, dim)
    # fp32 angle p * w for p < 600 carries ~600 * 6e-8 rad of rounding error.
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=0)
    # position 0: sin 0 = 0, cos 0 = 1, in each layout's slots
    zero = [0.0, 1.0, 0.0, 1.0] if layout == "interleaved" else [0.0, 0.0, 1.0, 1.0]
    np.testing.assert_array_equal(np.asarray(sinusoidal_positions(jnp.zeros(1, jnp.int32), 4, layout=layout)), [zero])


@pytest.mark.no_typecheck
def test_sinusoidal_odd_dim_or_unknown_layout_raises():
    with pytest.raises(ValueError, match="dim=7"):
        sinusoidal_positions(jnp.arange(3), 7)
    with pytest.raises(ValueError, match="layout='split' is not one of"):
        sinusoidal_positions(jnp.arange(3), 8, layout="split")


# ---------------------------------------------------------------- RoPE reference


def base_inv_freq(H, base=10000.0):
    return np.array([base ** (-2.0 * i / H) for i in range(H // 2)])


def rope_ref(x, positions, inv_freq, interleaved):
    """Explicit block-diagonal rotation matrix per (b, t), float64. x [B,T,N,H], positions [B,T]."""
    x = np.asarray(x, np.float64)
    B, T, N, H = x.shape
    pairs = [(2 * i, 2 * i + 1) for i in range(H // 2)] if interleaved else [(i, i + H // 2) for i in range(H // 2)]
    out = np.empty_like(x)
    for b in range(B):
        for t in range(T):
            R = np.zeros((H, H))
            for i, (a, c) in enumerate(pairs):
                th = float(positions[b, t]) * inv_freq[i]
                R[a, a], R[a, c], R[c, a], R[c, c] = math.cos(th), -math.sin(th), math.sin(th), math.cos(th)
            out[b, t] = x[b, t] @ R.T
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_rotation_matrix(interleaved):
    rng = np.random.default_rng(1)
    B, T, N, H = 2, 5, 3, 8
    x = rng.standard_normal((B, T, N, H)).astype(np.float32)
    pos = rng.integers(0, 60, size=(B, T))
    out = apply_rope(jnp.asarray(x), jnp.asarray(pos), base=500.0, interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == jnp.float32
    ref = rope_ref(x, pos, base_inv_freq(H, 500.0), interleaved)
    # fp32 angles < 60 rad: ~4e-6 rad error, |x| < 5.
    np.testing.assert_allclose(np.asarray(out), ref, atol=5e-5, rtol=0)


def test_rope_positions_t_broadcast_and_leading_dims():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 4, 2, 6)), jnp.float32)
    pos = jnp.array([3, 1, 4, 1])
    full = apply_rope(x, jnp.tile(pos[None], (2, 1)))
    np.testing.assert_array_equal(np.asarray(apply_rope(x, pos)), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(apply_rope(x, pos[None])), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(apply_rope(x[0], pos)), np.asarray(full[0]))


@pytest.mark.parametrize("interleaved", [False, True])
@given(shift=st.integers(0, 1024))
def test_rope_scores_depend_only_on_offset(interleaved, shift):
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32)
    pos = jnp.array([[0, 3, 7, 20]])

    def scores(p):
        qr = apply_rope(q, p, interleaved=interleaved)
        kr = apply_rope(k, p, interleaved=interleaved)
        return np.einsum("BTNH,BSNH->BNTS", np.asarray(qr, np.float64), np.asarray(kr, np.float64))

    bound = np.linalg.norm(np.asarray(q), axis=-1).max() * np.linalg.norm(np.asarray(k), axis=-1).max()
    # fp32 angles up to ~1044 rad carry ~1e-4 rad error each; scores scale with |q||k|.
    np.testing.assert_allclose(scores(pos + shift), scores(pos), atol=1e-3 * bound, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_norms(interleaved):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 3, 12)).astype(np.float32)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(rng.integers(0, 5000, (2, 6))), interleaved=interleaved))
    # rotation in fp32: relative error ~1e-6.
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_conventions_differ_by_permutation():
    rng = np.random.default_rng(5)
    H = 10
    x = jnp.asarray(rng.standard_normal((2, 3, 2, H)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 100, (2, 3)))
    perm = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])  # interleaved layout -> halves
    half = apply_rope(x[..., perm], pos)
    inter = apply_rope(x, pos, interleaved=True)
    np.testing.assert_allclose(np.asarray(half), np.asarray(inter)[..., perm], atol=1e-6, rtol=0)
    assert not np.allclose(np.asarray(apply_rope(x, pos)), np.asarray(inter), atol=1e-3)


def test_rope_bf16_in_bf16_out():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((1, 5, 2, 8)), jnp.bfloat16)
    pos = np.arange(5)[None] * 9
    out = apply_rope(x, jnp.asarray(pos))
    assert out.dtype == jnp.bfloat16
    ref = rope_ref(np.asarray(x.astype(jnp.float32)), pos, base_inv_freq(8), False)
    # Computed in fp32, rounded once to bf16 (8 mantissa bits): |err| <= 2^-8 |y| (+ tiny).
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=2 ** -8, atol=1e-3)


# ---------------------------------------------------------------- RoPE scaling


def test_linear_scaling_is_position_interpolation():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    pos = rng.integers(0, 400, (1, 6))
    lin = RopeScaling("linear", 4.0)
    out = apply_rope(jnp.asarray(x), jnp.asarray(pos), scaling=lin)
    ref = rope_ref(x, pos / 4.0, base_inv_freq(8), False)
    np.testing.assert_allclose(np.asarray(out), ref, atol=5e-5, rtol=0)  # angles < 100 rad in fp32
    # position 4p scaled by 4 == position p unscaled (theta/4 is exact in fp32).
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(4 * pos), scaling=lin)),
                               np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos))), atol=1e-5, rtol=0)


def test_ntk_scaling_base_change():
    H, base, s = 16, 10000.0, 8.0
    inv, af = rope_frequencies(H, base=base, scaling=RopeScaling("ntk", s))
    new_base = base * s ** (H / (H - 2))
    ref = np.array([new_base ** (-2.0 * i / H) for i in range(H // 2)])
    np.testing.assert_allclose(np.asarray(inv), ref, rtol=1e-6)  # fp32 rounding of float64 values
    plain = base_inv_freq(H, base)
    # the design intent: fastest pair untouched, slowest pair stretched by exactly s.
    assert inv[0] == pytest.approx(plain[0], rel=1e-6)
    assert inv[-1] == pytest.approx(plain[-1] / s, rel=1e-6)
    assert af == 1.0


def test_llama3_scaling_bands():
    H, base, s, L, low, high = 128, 500000.0, 8.0, 8192, 1.0, 4.0
    sc = RopeScaling("llama3", s, original_max_position=L, low_freq_factor=low, high_freq_factor=high)
    inv, af = rope_frequencies(H, base=base, scaling=sc)
    inv = np.asarray(inv, np.float64)
    plain = base_inv_freq(H, base)
    wavelen = 2 * math.pi / plain
    hi_band = wavelen < L / high
    lo_band = wavelen > L / low
    mid = ~hi_band & ~lo_band
    assert hi_band.sum() > 0 and lo_band.sum() > 0 and mid.sum() > 0
    np.testing.assert_allclose(inv[hi_band], plain[hi_band], rtol=1e-6)
    np.testing.assert_allclose(inv[lo_band], plain[lo_band] / s, rtol=1e-6)
    smooth = (L / wavelen[mid] - low) / (high - low)
    np.testing.assert_allclose(inv[mid], (1 - smooth) * plain[mid] / s + smooth * plain[mid], rtol=1e-6)
    assert np.all(np.diff(inv) < 0) and af == 1.0


def yarn_ref(H, base, s, L, alpha, beta):
    """YaRN paper §3.2-3.4: r(d) = L / lambda_d, gamma ramp, h(theta) = (1-g) theta/s + g theta."""
    theta = base_inv_freq(H, base)
    out = []
    for th in theta:
        r = L / (2 * math.pi / th)
        g = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        out.append((1 - g) * th / s + g * th)
    return np.array(out), theta


def test_yarn_ramp_and_temperature():
    H, base, s, L = 64, 10000.0, 16.0, 4096
    sc = RopeScaling("yarn", s, original_max_position=L)  # beta_slow=1 (alpha), beta_fast=32 (beta)
    inv, af = rope_frequencies(H, base=base, scaling=sc)
    ref, theta = yarn_ref(H, base, s, L, 1.0, 32.0)
    np.testing.assert_allclose(np.asarray(inv), ref, rtol=1e-6)
    r = L * theta / (2 * math.pi)
    # ramp endpoints: many rotations -> extrapolate (unchanged), < 1 rotation -> interpolate by s.
    assert (r > 32).sum() > 0 and (r < 1).sum() > 0 and ((r > 1) & (r < 32)).sum() > 0
    np.testing.assert_allclose(np.asarray(inv)[r > 32], theta[r > 32], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inv)[r < 1], theta[r < 1] / s, rtol=1e-6)
    assert af == pytest.approx(0.1 * math.log(16.0) + 1.0)
    assert rope_frequencies(H, scaling=RopeScaling("yarn", s, attention_factor=1.5))[1] == 1.5


def test_yarn_apply_scales_q_and_k_by_sqrt_inverse_temperature():
    rng = np.random.default_rng(8)
    H, s, L = 16, 4.0, 64
    sc = RopeScaling("yarn", s, original_max_position=L, beta_fast=8.0, beta_slow=0.5)
    q = rng.standard_normal((1, 5, 2, H)).astype(np.float32)
    k = rng.standard_normal((1, 5, 2, H)).astype(np.float32)
    pos = rng.integers(0, 200, (1, 5))
    ref_freq, _ = yarn_ref(H, 10000.0, s, L, 0.5, 8.0)
    mscale = 0.1 * math.log(s) + 1.0  # sqrt(1/t) in the paper
    qr = np.asarray(apply_rope(jnp.asarray(q), jnp.asarray(pos), scaling=sc), np.float64)
    kr = np.asarray(apply_rope(jnp.asarray(k), jnp.asarray(pos), scaling=sc), np.float64)
    q_ref, k_ref = rope_ref(q, pos, ref_freq, False), rope_ref(k, pos, ref_freq, False)
    np.testing.assert_allclose(qr, mscale * q_ref, atol=1e-4, rtol=0)  # fp32 angles < 200 rad
    logits = np.einsum("BTNH,BSNH->BNTS", qr, kr)
    # logits are scaled by 1/t = mscale^2 relative to plain rotated q.k.
    np.testing.assert_allclose(logits, mscale ** 2 * np.einsum("BTNH,BSNH->BNTS", q_ref, k_ref), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="linear", factor=0.5), "factor"),
    (dict(kind="cubic", factor=2.0), "kind"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor"),
    (dict(kind="yarn", factor=8.0, beta_fast=1.0, beta_slow=32.0), "beta_fast"),
    (dict(kind="yarn", factor=8.0, attention_factor=0.0), "attention_factor"),
    (dict(kind="linear", factor=2.0, attention_factor=1.2), "attention_factor"),
    (dict(kind="ntk", factor=2.0, original_max_position=0), "original_max_position"),
])
@pytest.mark.no_typecheck
def test_rope_scaling_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kwargs)


@pytest.mark.no_typecheck
def test_rope_bad_shapes_raise():
    x = jnp.zeros((2, 4, 3, 7))
    with pytest.raises(ValueError, match=r"x.shape=\(2, 4, 3, 7\)"):
        apply_rope(x, jnp.arange(4))
    x = jnp.zeros((2, 4, 3, 8))
    for pos in (jnp.arange(5), jnp.zeros((3, 4), jnp.int32), jnp.zeros((1, 2, 4), jnp.int32)):
        with pytest.raises(ValueError, match=r"x.shape=\(2, 4, 3, 8\).*positions.shape"):
            apply_rope(x, pos)
    with pytest.raises(ValueError, match="head_dim=2"):
        rope_frequencies(2, scaling=RopeScaling("ntk", 2.0))


def _trig_outputs(hlo: str) -> list[int]:
    """Elements written by each computation of a compiled program that evaluates a cosine or a sine: a fused
    computation's output (every output of a multi-output one), or a lone op's of the entry computation. Fusions and
    the entry only: a while body (``scan_layers``) or a called computation would be measured by its whole output,
    too strict, never too lax (the programs checked here have neither)."""
    sizes = []
    for m in re.finditer(r"^(?:ENTRY )?%?[\w.\-]+ \(.*?\) -> (.+?) \{\n(.*?)\n\}", hlo, re.S | re.M):
        head, body = m[1], m[2]
        if m[0].startswith("ENTRY"):  # unfused ops: each its own output
            sizes += [math.prod(map(int, filter(None, d.split(","))))
                      for d in re.findall(r"= \w+\[([\d,]*)\]\S* (?:cosine|sine)\(", body)]
        elif re.search(r" (?:cosine|sine)\(", body):
            sizes.append(max(math.prod(map(int, filter(None, d.split(","))))
                             for d in re.findall(r"\w+\[([\d,]*)\]", head)))
    return sizes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's fusion")
def test_rope_tables_are_computed_once_not_for_every_rotated_element():
    """On the CPU, RoPE's cos / sin tables are computed apart from the rotation: no compiled computation that
    evaluates cos / sin writes more than a table's elements (``[B, T, 1, H/2]``, or ``[T, 1, H/2]`` for positions
    ``[T]``). Fused into the rotation, XLA's CPU backend evaluates them for each of the ``[B, T, N, H]`` elements
    written, 2N times the transcendentals (6.3% of the main job's step). Counted work where the fusion happens
    today: the gradient of ``apply_rope`` alone (its forward writes a table's size either way, so it is not
    checked), and ``llama_tiny``'s forward and gradient (measured fused: 8 and 16 times a table's elements)."""
    B, T, N, H = 2, 32, 8, 16
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 100, (B, T)))
    w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

    def loss(x, pos):
        return (apply_rope(x, pos) * w).sum()

    sizes = _trig_outputs(jax.jit(jax.grad(loss)).lower(x, pos).compile().as_text())
    assert sizes and max(sizes) <= B * T * H // 2, sizes  # fused: 8192 = B T N H

    from jaxformer.model import apply, init, presets  # noqa: PLC0415 (a model only here)

    cfg = presets.get("llama_tiny")
    graphdef, state = init(cfg, jax.random.key(0))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    table = T * (cfg.d_model // cfg.attention.n_heads) // 2  # positions default to arange(T)

    def model_loss(state, tokens):
        return apply(graphdef, state, tokens).astype(jnp.float32).mean()

    for f in (model_loss, jax.grad(model_loss)):
        sizes = _trig_outputs(jax.jit(f).lower(state, tokens).compile().as_text())
        assert sizes and max(sizes) <= table, (sizes, table)


# ---------------------------------------------------------------- ALiBi


def test_alibi_slopes_power_of_two():
    np.testing.assert_array_equal(np.asarray(alibi_slopes(8)), [1 / 2 ** i for i in range(1, 9)])
    for n in (1, 2, 4, 16, 32):
        ref = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
        np.testing.assert_allclose(np.asarray(alibi_slopes(n)), ref, rtol=1e-7)  # fp32 rounding


def test_alibi_slopes_non_power_of_two_paper_recipe():
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence 2^(-i/2).
    ref12 = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    np.testing.assert_allclose(np.asarray(alibi_slopes(12)), ref12, rtol=1e-7)
    # 6 heads: 4-head slopes 2^(-2i), then 2^-1, 2^-3 from the 8-head sequence.
    ref6 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    np.testing.assert_allclose(np.asarray(alibi_slopes(6)), ref6, rtol=1e-7)
    with pytest.raises(ValueError, match="num_heads=0"):
        alibi_slopes(0)


@pytest.mark.no_typecheck
def test_alibi_bias_is_minus_m_abs_distance():
    slopes = alibi_slopes(4)
    qp, kp = np.array([5, 6, 7]), np.arange(8)
    out = np.asarray(alibi_bias(slopes, jnp.asarray(qp), jnp.asarray(kp)))
    assert out.shape == (4, 3, 8) and out.dtype == np.float32
    m = np.asarray(slopes, np.float64)
    for n in range(4):
        for i in range(3):
            for j in range(8):
                assert out[n, i, j] == pytest.approx(-m[n] * abs(int(qp[i]) - int(kp[j])), rel=1e-6)
    with pytest.raises(ValueError, match=r"slopes.shape=\(1, 4\)"):
        alibi_bias(slopes[None], jnp.asarray(qp), jnp.asarray(kp))


def test_alibi_bias_agrees_with_attention_alibi():
    rng = np.random.default_rng(9)
    B, T, S, N, H = 2, 3, 6, 4, 8
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.float32)
    slopes = alibi_slopes(N)
    mask = MaskSpec(causal=True)  # queries bottom-right aligned: positions S-T .. S-1
    bias = alibi_bias(slopes, jnp.arange(S - T, S), jnp.arange(S))
    a = dot_product_attention(q, k, v, mask=mask, alibi_slopes=slopes, impl="xla")
    b = dot_product_attention(q, k, v, mask=mask, bias=bias[None], impl="xla")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
