"""A decode step's matmuls in three weight layouts, side by side in one run: where a batched decode step's time
goes on XLA's CPU backend.

A decode step multiplies a few activation rows ``x [B, in]`` by every weight of the model. jaxformer stores a
projection as flax does, ``W [in, out]``, and computes ``x @ W``; PyTorch's ``nn.Linear`` stores ``W [out, in]``
and its BLAS computes ``(W @ x^T)^T``, rows of ``W`` against columns of ``x``. The three forms here compute the
same product (checked against a float64 numpy reference) over one 30-layer stack of SmolLM2-135M's matrices
(576 -> 960 q/k/v, 576 -> 576 out, 576 -> 3,072 gate/up, 1,536 -> 576 down: 106 M fp32 weights, 425 MB) at
batch rows ``B``:

- ``x @ W``, ``W [in, out]`` (jaxformer's layout; what the engine's step runs);
- ``x @ W^T``, ``W [out, in]`` (the contraction over both operands' last axis);
- ``W @ x^T``, ``W [out, in]``, the result feature-major ``[out, B]`` (PyTorch's form);
- the same, transposed back to rows behind an optimisation barrier (``jaxformer.nn.params.project_t``: what the
  engine's feature-major steps run for the attention's projections and the head);
- with ``--bf16``, also ``x @ W`` with bfloat16 weights and rows, accumulated in float32 (checked against the
  float64 product of the rounded operands): whether XLA's CPU dot gains from half the bytes (or from AMX on a
  CPU that has it); and, up to 4 rows (n/a past that: it does every product as a loop), the same product as a
  multiply-and-reduce over the bfloat16 weights converted in the loop, a form that reads half the bytes
  without the dot.

Milliseconds per stack (median of ``--repeats``, compile excluded) and each form's time against the first.

``--stream`` adds what bounds a batched decode step's products: one dependent chain of 30 feature-major
``[1536, 576]`` products (``project_t``, each layer's input the last one's output) over 30 distinct weights
(streamed from memory, as a step reads them) and over one weight reused 30 times (in cache), beside a plain read
of the same 30 weights (a jitted sum, the weights read independently: both cores) and the same read one weight
after another (each sum waiting for the last, as the chain's products do): the GB/s of weights the products
stream against what the cores read.

    python experiments/bench/decode_matmul.py [--rows 1 2 4 8 16 32 256] [--repeats 15] [--bf16] [--head] [--stream]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cpu_line, median_seconds  # noqa: E402

from jaxformer.nn.params import project_t  # noqa: E402

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of one layer's matrices
HEAD = (576, 49152)  # SmolLM2-135M's tied head (--head)


def forms():
    """The forms as jitted functions of (weights, x), each with its weights' layout key: each returns the
    products' column sums per matrix (so nothing is dead code and the check compares every product)."""

    def x_w(ws, x):  # ws: [in, out]
        return [(x[:, : w.shape[0]] @ w).sum(0) for w in ws]

    def x_wt(ws, x):  # ws: [out, in]
        return [jax.lax.dot_general(x[:, : w.shape[1]], w, (((1,), (1,)), ((), ()))).sum(0) for w in ws]

    def w_xt(ws, x):  # ws: [out, in]; the result [out, B]
        return [jax.lax.dot_general(w, x[:, : w.shape[1]], (((1,), (1,)), ((), ()))).sum(1) for w in ws]

    def w_xt_rows(ws, x):  # ws: [out, in]; W @ x^T, then back to rows behind a barrier (the library's project_t)
        return [project_t(x[:, : w.shape[1]], w, jnp.float32).sum(0) for w in ws]

    def x_w_bf16(ws, x):  # ws: [in, out] bfloat16
        x = x.astype(jnp.bfloat16)
        return [jnp.matmul(x[:, : w.shape[0]], w, preferred_element_type=jnp.float32).sum(0) for w in ws]

    def reduce_bf16(ws, x):  # ws: [in, out] bfloat16, converted inside the multiply-and-reduce; row by row (the
        # rows' axis in the reduce makes XLA's CPU loop 15x slower at one row)
        return [sum((x[b, : w.shape[0], None] * w.astype(jnp.float32)).sum(0) for b in range(x.shape[0]))
                for w in ws]

    return {"x @ W, W [in, out]": (jax.jit(x_w), "in_out"), "x @ W^T, W [out, in]": (jax.jit(x_wt), "out_in"),
            "W @ x^T, W [out, in]": (jax.jit(w_xt), "out_in"),
            "W @ x^T back to rows (project_t)": (jax.jit(w_xt_rows), "out_in"),
            "x @ W bf16, W [in, out]": (jax.jit(x_w_bf16), "bf16"),
            "sum(x * W) bf16, W [in, out]": (jax.jit(reduce_bf16), "bf16_f32x")}


MAX_ROWS = {"bf16_f32x": 4}  # forms timed only up to this many rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 256])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--bf16", action="store_true", help="also the first form in bfloat16 (float32 accumulation)")
    ap.add_argument("--head", action="store_true", help="also the tied head, 576 -> 49,152, once in the stack")
    ap.add_argument("--stream", action="store_true",
                    help="also the weights' streaming rate of a chain of products against a plain read")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w_in_out = [rng.standard_normal(s, np.float32) * 0.02 for _ in range(LAYERS) for s in SHAPES]
    w_in_out += [rng.standard_normal(HEAD, np.float32) * 0.02] if args.head else []
    by_layout = {"in_out": [jnp.asarray(w) for w in w_in_out],
                 "out_in": [jnp.asarray(np.ascontiguousarray(w.T)) for w in w_in_out]}
    if args.bf16:
        by_layout["bf16"] = by_layout["bf16_f32x"] = [jnp.asarray(w, jnp.bfloat16) for w in w_in_out]
    width = max(s[0] for s in SHAPES)
    table = {k: v for k, v in forms().items() if args.bf16 or not v[1].startswith("bf16")}
    print(cpu_line())
    print(f"{LAYERS} layers x {len(SHAPES)} matrices{' + the head' if args.head else ''}, "
          f"{sum(w.size for w in w_in_out) / 1e6:.0f} M fp32 weights; "
          f"ms per stack, median of {args.repeats}\n")
    names = list(table)
    print("| rows B | " + " | ".join(names) + " | " + " | ".join(f"{n.split(',')[0]} / first" for n in names[1:])
          + " |")
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for B in args.rows:
        x = rng.standard_normal((B, width), np.float32)
        want = [(x[:, : w.shape[0]].astype(np.float64) @ w.astype(np.float64)).sum(0) for w in w_in_out]
        ms = []
        for name in names:
            fn, layout = table[name]
            if B > MAX_ROWS.get(layout, B):
                ms.append(None)
                continue
            ws, xj = by_layout[layout], jnp.asarray(x)
            got = fn(ws, xj)
            if layout.startswith("bf16"):  # the product of the rounded weights (and rows), exact in float64
                xr = x.astype(np.float64) if layout == "bf16_f32x" else \
                    np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
                ref = [(xr[:, : w.shape[0]] @ np.asarray(w.astype(jnp.float32), np.float64)).sum(0) for w in ws]
            else:
                ref = want
            for g, r in zip(got, ref):  # fp32 sums of B * in products of ~N(0, 0.02^2) terms
                np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-4 * np.sqrt(B), err_msg=name)
            ms.append(1e3 * median_seconds(fn, ws, xj, repeats=args.repeats))
        print(f"| {B} | " + " | ".join("n/a" if m is None else f"{m:.1f}" for m in ms) + " | "
              + " | ".join("n/a" if m is None else f"{m / ms[0]:.2f}" for m in ms[1:]) + " |", flush=True)
    if args.stream:
        stream_table(args.rows, args.repeats, rng)
    return 0


def stream_table(rows_list, repeats, rng, out: int = 1536, width: int = 576, n: int = LAYERS):
    """Print, per row count, a dependent chain of ``n`` feature-major ``[out, width]`` products over distinct
    weights and over one weight reused, and a jitted sum reading the distinct weights: ms, GFLOP/s, GB/s."""
    distinct = [jnp.asarray(rng.standard_normal((out, width), np.float32) * 0.02) for _ in range(n)]
    reused = [distinct[0]] * n

    @jax.jit
    def chain(ws, x):  # each product's input is the last one's output: nothing runs side by side
        for w in ws:
            x = x + project_t(x, w, jnp.float32)[:, :width] * 1e-3
        return x

    read = jax.jit(lambda ws: sum(w.sum() for w in ws))

    @jax.jit
    def read_chained(ws):  # each weight's sum waits for the last one's (plus 0 unless it is NaN), as the products do
        acc = jnp.zeros((), jnp.float32)
        for w in ws:
            acc = acc + (w + (acc != acc).astype(w.dtype)).sum()
        return acc

    weight_bytes = n * out * width * 4
    t_read, t_chained = (median_seconds(f, distinct, repeats=repeats) for f in (read, read_chained))
    print(f"\nA chain of {n} feature-major [{out}, {width}] products ({weight_bytes / 1e6:.0f} MB of distinct "
          f"weights); a plain read of them (jitted sum) {t_read * 1e3:.1f} ms = "
          f"{weight_bytes / t_read / 1e9:.1f} GB/s; read one after another (each sum waiting for the last, as the "
          f"chain's products do) {t_chained * 1e3:.1f} ms = {weight_bytes / t_chained / 1e9:.1f} GB/s\n")
    print("| rows B | distinct weights ms | GFLOP/s | weights GB/s | one weight reused ms | GFLOP/s "
          "| distinct / reused | weights GB/s / plain read |")
    print("|---|---|---|---|---|---|---|---|")
    for B in rows_list:
        x = jnp.asarray(rng.standard_normal((B, width), np.float32))
        ref = np.asarray(x, np.float64)
        for w in distinct:  # the chain in float64: the check that the timed chain computes it
            ref = ref + (ref @ np.asarray(w, np.float64).T)[:, :width] * 1e-3
        np.testing.assert_allclose(np.asarray(chain(distinct, x)), ref, rtol=1e-4, atol=1e-4)
        t_d, t_r = (median_seconds(chain, ws, x, repeats=repeats) for ws in (distinct, reused))
        flop = 2 * B * out * width * n
        gbs = weight_bytes / t_d / 1e9
        print(f"| {B} | {t_d * 1e3:.1f} | {flop / t_d / 1e9:.0f} | {gbs:.1f} | {t_r * 1e3:.1f} | "
              f"{flop / t_r / 1e9:.0f} | {t_d / t_r:.2f} | {gbs / (weight_bytes / t_read / 1e9):.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
