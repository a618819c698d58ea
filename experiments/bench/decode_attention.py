"""A batched decode step's attention over pages on XLA's CPU backend, taken apart, side by side in one run.

At SmolLM2-135M's heads (9 query heads over 3 kv heads, head dim 64, pages of 16 tokens), ``--rows`` sequences
each attending over ``--pages`` pages, through ``--layers`` layers with their own page pools (so the pages come
from memory, as in a step that streams the weights between layers), each layer's query the last one's output:

- ``paged_attention`` as the engine's decode step calls it (``backend="auto"``: the reference form below
  ``XLA_MIN_POSITIONS`` table positions);
- the xla form (``paged_attention_xla``: whole-row gathers, logits with the keys as the product's rows);
- the two page gathers alone (``gather_rows``, materialised behind an optimisation barrier, then summed);
- the attention over the same keys and values already contiguous, ``[B, K, S, H]``: the reference's math with
  no gather; then its logits alone, and its weighted sum of the values alone;
- a plain read of the same bytes (a jitted sum of the contiguous keys and values).

Milliseconds per stack (median over ``--repeats`` rounds, the forms alternating within each round, compile
excluded), the keys' and values' GB/s, and each form's time against the plain read. The paged forms and the
contiguous one are checked against each other, and the first layer against a float64 NumPy attention.

    python experiments/bench/decode_attention.py [--rows 16] [--pages 4 8 16] [--layers 30] [--repeats 11]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cpu_line  # noqa: E402

from pallas_kernels.paged_attention import paged_attention  # noqa: E402
from pallas_kernels.paged_attention.reference import decode_weights  # noqa: E402
from pallas_kernels.paged_attention.xla import gather_rows, paged_attention_xla  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM, PAGE = 3, 3, 64, 16  # SmolLM2-135M: 9 query heads over 3 kv heads, head dim 64


def contiguous(q, k, v, lengths):
    """The reference's attention over keys and values already laid out ``[B, K, S, H]`` (no gather)."""
    B = q.shape[0]
    s = jnp.einsum("BKGH,BKSH->BKGS", q.reshape(B, KV_HEADS, GROUP, HEAD_DIM), k) / math.sqrt(HEAD_DIM)
    w = decode_weights(s, lengths)
    return jnp.einsum("BKGS,BKSH->BKGH", w, v).reshape(q.shape)


def logits_only(q, k, v, lengths):
    B = q.shape[0]
    s = jnp.einsum("BKGH,BKSH->BKGS", q.reshape(B, KV_HEADS, GROUP, HEAD_DIM), k)
    return jnp.broadcast_to(s.sum(-1).reshape(B, -1, 1), q.shape)


def values_only(q, k, v, lengths):  # the query's first feature as the weights: the weighted sum's cost alone
    B, S = q.shape[0], v.shape[2]
    w = jnp.broadcast_to(q[:, :, :1].reshape(B, KV_HEADS, GROUP, 1), (B, KV_HEADS, GROUP, S))
    return jnp.einsum("BKGS,BKSH->BKGH", w, v).reshape(q.shape)


def gathers_only(q, k_pages, v_pages, tables, lengths):  # materialised; one element each out (a sum to a scalar
    # would cost XLA's CPU backend more than the gathers)
    k, v = jax.lax.optimization_barrier((gather_rows(k_pages, tables), gather_rows(v_pages, tables)))
    return jnp.broadcast_to(k[0, 0, 0, 0] + v[0, 0, 0, 0], q.shape)


def plain_read(q, k, v, lengths):  # the bytes depend on the chain's query (plus 0 unless it is NaN), as the forms'
    # reads do: no layer's read runs ahead of the chain
    zero = (q[0, 0, 0] != q[0, 0, 0]).astype(k.dtype)
    return jnp.broadcast_to((k + zero).sum() + (v + zero).sum(), q.shape)


def stack(form, paged: bool):
    """``form`` through the layers: ``q`` plus a small multiple of each layer's output (a dependent chain). A
    paged form's block tables depend on the layer's query (plus 0 unless it is NaN), as in a step, where a layer's
    pages hold the token its input wrote: so no layer's gathers run ahead of the chain."""

    @jax.jit
    def run(q, ks, vs, *rest):
        for k, v in zip(ks, vs):
            if paged:
                tables, lengths = rest
                args = (tables + (q[0, 0, 0] != q[0, 0, 0]).astype(tables.dtype), lengths)
            q = q + 1e-3 * form(q, k, v, *(args if paged else rest))
        return q

    return run


def float64_attention(q, k, v, lengths):
    """One layer in float64 NumPy: ``q [B, N, H]``, contiguous ``k, v [B, K, S, H]``."""
    B = q.shape[0]
    q = q.astype(np.float64).reshape(B, KV_HEADS, GROUP, HEAD_DIM)
    s = np.einsum("bkgh,bksh->bkgs", q, k.astype(np.float64)) / math.sqrt(HEAD_DIM)
    s = np.where(np.arange(k.shape[2]) < lengths[:, None, None, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", w, v.astype(np.float64)).reshape(B, -1, HEAD_DIM)


def one_width(rows: int, pages: int, layers: int, repeats: int, rng) -> list[tuple[str, float]]:
    """The forms' median ms at one table width; raises if the forms disagree."""
    pool = rows * pages + 8  # a few pages no table holds, as in an engine's pool
    shape = (KV_HEADS, pool, PAGE, HEAD_DIM)
    k_pools = [rng.standard_normal(shape, np.float32) for _ in range(layers)]
    v_pools = [rng.standard_normal(shape, np.float32) for _ in range(layers)]
    tables = rng.permutation(pool)[: rows * pages].reshape(rows, pages).astype(np.int32)
    lengths = np.maximum(1, pages * PAGE - rng.integers(0, PAGE, rows)).astype(np.int32)  # last page part-filled

    def laid_out(p):  # [K, P, L, H] -> each row's pages contiguous, [B, K, M*L, H]
        return np.ascontiguousarray(p[:, tables].transpose(1, 0, 2, 3, 4).reshape(rows, KV_HEADS, -1, HEAD_DIM))

    k_rows, v_rows = [laid_out(p) for p in k_pools], [laid_out(p) for p in v_pools]
    q = rng.standard_normal((rows, KV_HEADS * GROUP, HEAD_DIM), np.float32)
    np.testing.assert_allclose(  # one layer of the engine's form against float64, fp32 tolerance for S <= 256 keys
        np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(k_pools[0]), jnp.asarray(v_pools[0]),
                                   jnp.asarray(tables), jnp.asarray(lengths))),
        float64_attention(q, k_rows[0], v_rows[0], lengths), rtol=1e-5, atol=1e-5)
    paged = (jnp.asarray(q), [jnp.asarray(p) for p in k_pools], [jnp.asarray(p) for p in v_pools],
             jnp.asarray(tables), jnp.asarray(lengths))
    flat = (jnp.asarray(q), [jnp.asarray(p) for p in k_rows], [jnp.asarray(p) for p in v_rows], jnp.asarray(lengths))
    forms = {"paged_attention (engine)": (stack(paged_attention, True), paged),
             "xla form": (stack(paged_attention_xla, True), paged),
             "gathers alone": (stack(gathers_only, True), paged),
             "contiguous keys": (stack(contiguous, False), flat),
             "its logits alone": (stack(logits_only, False), flat),
             "its values alone": (stack(values_only, False), flat),
             "plain read": (stack(plain_read, False), flat)}
    outs = {name: np.asarray(fn(*args)) for name, (fn, args) in forms.items()}  # compiles
    for name in ("xla form", "contiguous keys"):  # the same attention three ways: chains agree to fp32 rounding
        np.testing.assert_allclose(outs[name], outs["paged_attention (engine)"], rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    times = {name: [] for name in forms}
    for _ in range(repeats):
        for name, (fn, args) in forms.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return [(name, statistics.median(t) * 1e3) for name, t in times.items()]


def fixed(x: float) -> str:
    """A ratio or a rate to one decimal, three below 1: the toy size's test reads every column as a positive number,
    and failed once on a loaded machine (which column printed 0.0 was not recorded; the GB/s column does from 5.9 ms
    for the toy size's 0.295 MB, the ratio where one plain-read sample stalls to ~20x the engine's time)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--pages", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(cpu_line())
    print(f"{args.rows} sequences, SmolLM2-135M's heads ({KV_HEADS * GROUP} over {KV_HEADS} kv, head dim {HEAD_DIM}), "
          f"pages of {PAGE}, {args.layers} layers; ms per stack, median of {args.repeats} alternating rounds\n")
    header = None
    for pages in args.pages:
        res = one_width(args.rows, pages, args.layers, args.repeats, rng)
        if header is None:
            header = [name for name, _ in res]
            print("| pages | MB of keys + values | " + " | ".join(header) + " | engine's form / plain read | "
                  "GB/s, engine's form |")
            print("|---" * (len(header) + 4) + "|")
        mb = 2 * args.layers * args.rows * KV_HEADS * pages * PAGE * HEAD_DIM * 4 / 1e6
        ms = dict(res)
        print(f"| {pages} | {mb:.1f} | " + " | ".join(f"{ms[n]:.2f}" for n in header)
              + f" | {fixed(ms[header[0]] / ms['plain read'])} | {fixed(mb / ms[header[0]])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
