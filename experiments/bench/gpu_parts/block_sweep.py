"""(e) a block-size sweep of the flash kernel, the best tiles per shape as a proposed table (see
``gpu_suite.py``)."""

from __future__ import annotations

from gpu_parts.common import Part, bench, normal

import math



# =========================================================================== (e) block-size sweep


# Candidates per kernel: tiles (block_q, block_k) at the table's warps/stages, then the table's tile at
# other launch settings (warps, stages); each kernel swept with the other two at the dispatcher's choice.
# Tiles the table does not hold have not been compile-checked for spills: check a winner with
# experiments/bench/gpu_compile.py before adopting it.
SWEEP_TILES = {"fwd": ((64, 64), (128, 128), (64, 128)),
               "dq": ((64, 64), (64, 128), (128, 128)),
               "dkv": ((64, 64), (32, 128), (128, 64), (32, 64))}
SWEEP_TILES_DRY = {"fwd": ((16, 16), (32, 16)), "dq": ((16, 16),), "dkv": ((16, 16),)}
SWEEP_LAUNCH = ((None, 3), ("other", 2))  # (warps: None = the table's, "other" = 4 <-> 8; stages)


def ms(t: float, spec: str = ".3f") -> str:
    """Seconds as milliseconds (``spec``), 'traced' for a NaN (a dry run's traced-only call)."""
    return "traced" if math.isnan(t) else format(1e3 * t, spec)


def _sweep_backend():
    """``pallas_kernels.block_table`` when it offers the dispatcher's table (lookup + overriding), else None
    (the sweep then passes ``block_sizes``: tiles only)."""
    try:
        from pallas_kernels import block_table
    except ImportError:
        return None
    need = ("lookup", "overriding", "gpu_arch", "head_dim_key", "dtype_key", "KernelConfig")
    return block_table if all(hasattr(block_table, n) for n in need) else None


def part_e(p: Part) -> None:
    import contextlib

    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import BlockSizes, flash_attention

    bt = _sweep_backend()
    if p.dry:
        shapes, N, tokens, tiles, launches = ((32, 64),), 2, 64, SWEEP_TILES_DRY, SWEEP_LAUNCH[:1]
    else:
        shapes, N, tokens, tiles, launches = ((128, 4096), (64, 4096)), 16, 16384, SWEEP_TILES, SWEEP_LAUNCH
    dtype = jnp.bfloat16
    arch = bt.gpu_arch() if bt else None
    p.line(f"bf16, causal, N={N}, B*T = {tokens} tokens. The forward's candidates timed on the forward; dq's and "
           "dk/dv's on forward+backward, the other kernels at the dispatcher's choice. "
           + (f"Candidates override entries of pallas_kernels.block_table (arch {arch}): tile, warps, stages. "
              if bt else "pallas_kernels.block_table not found: candidates are passed as block_sizes (tiles only). ")
           + "ms: median per call; 'vs table': the dispatcher's choice's time / this one's."
           + (" Dry run: the first two timings run (interpret mode), the rest are only traced." if p.tracing else ""))
    p.line("")
    p.line("| H | T | kernel | block_q, block_k, warps, stages | ms | vs table |")
    p.line("|---:|---:|---|---|---:|---:|")
    best = {}
    ran = [0]  # a dry run runs the first two timings and traces the rest

    def timing(fn, args, override):
        trace = p.tracing and ran[0] >= 2
        ran[0] += 1
        ctx = bt.overriding(override) if (bt and override) else contextlib.nullcontext()
        with ctx:  # the table is read when the call is traced, inside bench's first call
            return p.case(bench, fn, *args, dry=p.dry, trace=trace)[0]

    for H, T in shapes:
        B = max(1, tokens // T)
        q, k, v, do = (normal(30 + i, (B, T, N, H), dtype) for i in range(4))

        def fwd_fn(bs):
            return jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=bs, backend="gpu",
                                                           interpret=p.dry))

        def bwd_fn(bs):
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash_attention(
                q, k, v, causal=True, block_sizes=bs, backend="gpu", interpret=p.dry).astype(jnp.float32)
                * do.astype(jnp.float32)), argnums=(0, 1, 2)))

        Hp = max(16, 1 << (H - 1).bit_length())
        for kernel in ("fwd", "dq", "dkv"):
            make = fwd_fn if kernel == "fwd" else bwd_fn
            label = f"H={H} T={T} {kernel} table"
            if not p.room(label):
                continue
            if bt:
                key = (arch, bt.head_dim_key(Hp), bt.dtype_key(dtype), kernel)
                cur = bt.lookup(kernel, Hp, dtype, arch)
                now = (cur.block_q, cur.block_k, cur.num_warps, cur.num_stages)
            else:
                r = BlockSizes.default("gpu").resolved().as_dict()
                suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv"}[kernel]
                now = (r["block_q" + suffix], r["block_k" + suffix], None, None)
            try:
                t_def = timing(make(None), (q, k, v), None)
            except Exception as e:  # noqa: BLE001
                p.fails.append(f"{label}: {p.error(label, e)}")
                continue
            p.line(f"| {H} | {T} | {kernel} | table: {', '.join(map(str, now))} | {ms(t_def)} | 1.00 |")
            cands = [(bq, bk, now[2], now[3]) for bq, bk in tiles[kernel] if (bq, bk) != now[:2]]
            if bt:
                for warps, stages in launches:
                    w = now[2] if warps is None else (8 if now[2] == 4 else 4)
                    cands.append((now[0], now[1], w, stages))
            top = (t_def, now)
            for cand in cands:
                label = f"H={H} T={T} {kernel} {cand}"
                if not p.room(label):
                    continue
                try:
                    if bt:
                        t = timing(make(None), (q, k, v), {key: bt.KernelConfig(*cand)})
                    else:
                        r = BlockSizes.default("gpu").resolved().as_dict()
                        r.update({"block_q" + suffix: cand[0], "block_k" + suffix: cand[1]})
                        t = timing(make(BlockSizes(**r)), (q, k, v), None)
                except Exception as e:  # noqa: BLE001 -- e.g. a tile over the shared-memory budget
                    p.line(f"| {H} | {T} | {kernel} | {', '.join(map(str, cand))} | error: "
                           f"{p.error(label, e)[:80]} | |")
                    continue
                p.line(f"| {H} | {T} | {kernel} | {', '.join(map(str, cand))} | {ms(t)} | "
                       f"{'traced' if math.isnan(t) else f'{t_def / t:.2f}'} |")
                if t < top[0]:
                    top = (t, cand)
            best[(H, T, kernel)] = (top[1], now, None if math.isnan(t_def) else t_def / top[0])
    lines = ["", f"Best per shape{' (proposed block_table entries: paste into its generated block after a spill check)' if bt else ''}:",
             "", "```python"]
    for (H, T, kernel), (cand, now, gain) in best.items():
        if bt:
            key = (arch, bt.head_dim_key(max(16, 1 << (H - 1).bit_length())), "bf16", kernel)
            lines.append(f"    {key!r}: KernelConfig({', '.join(map(str, cand))}),  # x{gain or float('nan'):.2f} vs "
                         f"table {now} at T={T}, causal")
        else:
            lines.append(f"    ({H}, 'bf16', {kernel!r}): (block_q, block_k) = {cand[:2]},  # x{gain or float('nan'):.2f} "
                         f"vs default {now[:2]} at T={T}, causal")
    lines.append("```")
    p.line("\n".join(lines))
    p.finish(summary=f"{len(best)} kernel x shape entries swept")



