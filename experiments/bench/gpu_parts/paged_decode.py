"""(c) paged decode bandwidth beside a copy, JAX's paged kernel and a contiguous cache (see ``gpu_suite.py``)."""

from __future__ import annotations

import warnings

from gpu_parts.common import Part, bench, normal, rel_err
from gpu_parts.correctness import TOL_PAGED, dry_lowering



# =========================================================================== (c) paged decode


def part_c(p: Part) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import gather_pages, paged_attention

    if p.dry:
        B, N, K, H, L, ctxs = 2, 4, 1, 16, 16, (32,)
    else:
        B, N, K, H, L, ctxs = 64, 32, 8, 128, 16, (2048, 4096, 8192)
    dtype = jnp.bfloat16
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except Exception as e:  # noqa: BLE001
        jax_paged = None
        p.line(f"- JAX's Pallas paged_attention: not available: {type(e).__name__}: {e}"[:160])
    p.line(f"Decode, B={B}, N={N} query heads on K={K} kv heads (GQA {N // K}:1), H={H}, pages of L={L} tokens "
           f"shuffled in the pool, bf16, every sequence at the full context. KV GB/s = K/V bytes of the pages in "
           "use / time; copy = read + write bytes / time of a device-to-device copy of both pools. "
           "'contig': jax.nn.dot_product_attention on a contiguous [B,S,K,H] cache (same data). "
           "err: max|ours - contig xla| / max(1, max|contig|).")
    if p.dry:  # both paged kernels at the GPU's largest context, lowered for CUDA
        gB, gM, gP = 64, 8192 // 16, 64 * (8192 // 16)
        specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in (
            ((gB, 32, 128), dtype), ((8, gP, 16, 128), dtype), ((8, gP, 16, 128), dtype), ((gB, gM), jnp.int32),
            ((gB,), jnp.int32))]
        dry_lowering(p, "ours, context 8192", lambda *a: paged_attention(*a, backend="gpu"), *specs)
        if jax_paged is not None:
            dry_lowering(p, "jax-pallas-paged, context 8192",
                         lambda *a: jax_paged.paged_attention(*a, k_splits=16), *specs)
    p.line("")
    cols = ["ours", "jax-pallas-paged", "contig-xla", "contig-cudnn"]
    p.line("| context | KV MiB | copy GB/s | " + " | ".join(f"{c} us" for c in cols)
           + " | ours KV GB/s | ours / copy | jax-pallas-paged / ours time | contig-xla / ours time | err |")
    p.line("|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    worst = None
    notes: dict[str, str] = {}  # first error of each anchor, listed below the table
    for ctx in ctxs:
        if not p.room(f"context {ctx}"):
            continue
        M = ctx // L
        P = B * M
        q = normal(10, (B, N, H), dtype)
        kp, vp = normal(11, (K, P, L, H), dtype), normal(12, (K, P, L, H), dtype)
        tables = jnp.asarray(rng.permutation(P).reshape(B, M), jnp.int32)
        lengths = jnp.full((B,), ctx, jnp.int32)
        kc, vc = gather_pages(kp, tables), gather_pages(vp, tables)  # [B, ctx, K, H]
        kv_bytes = 2 * B * ctx * K * H * jnp.dtype(dtype).itemsize
        fns = {
            "ours": (jax.jit(lambda q, kp, vp, t, n: paged_attention(q, kp, vp, t, n, backend="gpu",
                                                                       interpret=p.dry)), (q, kp, vp, tables, lengths)),
            "contig-xla": (jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="xla")[:, 0]), (q, kc, vc, lengths)),
            "contig-cudnn": (jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn")[:, 0]), (q, kc, vc, lengths)),
        }
        for name in p.skip & set(fns):
            del fns[name]
        if jax_paged is not None and "jax-pallas-paged" not in p.skip:
            splits = min(16, M)
            fns["jax-pallas-paged"] = (jax.jit(lambda q, kp, vp, t, n: jax_paged.paged_attention(
                q, kp, vp, t, n, k_splits=splits, interpret=p.dry)), (q, kp, vp, tables, lengths))
        secs, outs = {}, {}
        copy = jax.jit(lambda a, b: (jnp.copy(a), jnp.copy(b)))

        def measure():
            for name, (fn, args) in fns.items():
                try:
                    secs[name], first = bench(fn, *args, dry=p.dry)
                    outs[name] = fn(*args)
                    p.console(f"    context {ctx} {name}: {1e6 * secs[name]:.0f} us (first call {first:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    secs[name] = None
                    msg = p.error(f"{name} context {ctx}", e)
                    if name == "ours":
                        p.fails.append(f"ours context {ctx}: {msg}")
                    else:
                        notes.setdefault(name, f"context {ctx}: {msg}")
            return bench(copy, kp, vp, dry=p.dry)[0]

        t_copy = p.case(measure)
        copy_bw = 4 * kp.size * kp.dtype.itemsize / t_copy  # read + write, both pools
        err = rel_err(outs["ours"], outs["contig-xla"]) if "ours" in outs and "contig-xla" in outs else None
        tol = TOL_PAGED["bfloat16"]
        if err is not None and err > tol:
            p.fails.append(f"context {ctx}: ours differs from the contiguous xla decode: {err:.2e} > {tol}")
        t_ours = secs.get("ours")
        bw = None if t_ours is None else kv_bytes / t_ours
        frac = None if bw is None else bw / copy_bw
        worst = frac if worst is None or (frac is not None and frac < worst) else worst

        def us(x):
            return "-" if x is None else f"{1e6 * x:.0f}"

        def rt(a, b):
            return "-" if a is None or b is None else f"{a / b:.2f}"

        p.line(f"| {ctx} | {kv_bytes / 2**20:,.0f} | {copy_bw / 1e9:,.0f} | "
               + " | ".join(us(secs.get(c)) for c in cols)
               + f" | {'-' if bw is None else f'{bw / 1e9:,.0f}'} | {'-' if frac is None else f'{frac:.0%}'} | "
               f"{rt(secs.get('jax-pallas-paged'), t_ours)} | {rt(secs.get('contig-xla'), t_ours)} | "
               f"{'-' if err is None else f'{err:.1e}'} |")
    if notes:
        p.line("\nFirst error of each anchor:\n" + "\n".join(f"- {k}: {v}" for k, v in notes.items()))
    p.line("\nGoal (issue 16): paged decode >= 80% of copy bandwidth: "
           + ("-" if worst is None else f"worst {worst:.0%}, {'met' if worst >= 0.8 else 'NOT met'}"))
    p.finish(summary="-" if worst is None else f"worst {worst:.0%} of copy")


