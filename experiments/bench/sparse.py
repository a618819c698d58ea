"""Sparse-attention benchmark on CPU: block-sparse path vs dense XLA vs blockwise full attention.

Workloads (self-attention, B=1, fp32, T = S):

* ``longformer``: window 512 (``(256, 256)``) plus 2 global tokens (positions 0, 1);
* ``bigbird``: window ``(64, 64)``, 2 global tokens and 3 random blocks of 64.

Paths: ``sparse`` (:func:`jaxformer.ops.sparse.sparse_attention`, same mask),
``dense`` (:func:`jaxformer.ops.xla_attention`, same mask, the ``T x S`` matrix)
and ``blockwise`` (:func:`jaxformer.ops.blockwise.blockwise_attention` with no
mask: O(T) memory but all ``T x S`` work -- what you would run without a sparse
path). Every case runs in a fresh subprocess; compile is excluded from the time
(median of timed runs after one warm-up). Memory: ``temp`` is XLA's compiled
``memory_analysis().temp_size_in_bytes`` (scratch beyond inputs and outputs);
``rss`` the resident-set high-water mark around the timed calls. A case whose
``temp`` exceeds ``--mem-limit-gb`` is compiled but not run (its temp is still
reported). The scaling exponent is the least-squares slope of log(time) vs log(T).

    python experiments/bench/sparse.py --out experiments/results/sparse_cpu.md
    python experiments/bench/sparse.py --max-t 2048 --repeats 1      # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from procmem import proc_kb, reset_hwm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TS = (1024, 2048, 4096, 8192, 16384)
WORKLOADS = ("longformer", "bigbird")
IMPLS = ("sparse", "dense", "blockwise")
MODES = ("fwd", "fwd+bwd")


DESCRIBE = {
    "longformer": "window (256, 256) + global tokens [0, 1]",
    "bigbird": "window (64, 64) + global tokens [0, 1] + RandomBlocks(num_blocks=3, block_size=64, seed=0)",
}


def make_mask(workload: str):
    from jaxformer.ops.masks import MaskSpec, RandomBlocks

    if workload == "longformer":
        return MaskSpec(window=(256, 256), global_tokens=[0, 1])
    if workload == "bigbird":
        return MaskSpec(window=(64, 64), global_tokens=[0, 1], random_blocks=RandomBlocks(3, 64, seed=0))
    raise ValueError(f"workload={workload!r} is not one of {WORKLOADS}")


def worker(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxformer.ops import MaskSpec, xla_attention
    from jaxformer.ops.sparse import sparse_attention

    T, N, H = case["T"], case["heads"], case["head_dim"]
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float32) for _ in range(4))
    mask = None if case["workload"] == "*" else make_mask(case["workload"])
    if case["impl"] == "sparse":
        attn = lambda q, k, v: sparse_attention(q, k, v, mask=mask, block_size=case["block"])  # noqa: E731
    elif case["impl"] == "dense":
        attn = lambda q, k, v: xla_attention(q, k, v, mask=mask)  # noqa: E731
    else:
        from jaxformer.ops.blockwise import blockwise_attention
        attn = lambda q, k, v: blockwise_attention(q, k, v, mask=MaskSpec())  # noqa: E731
    fn = attn if case["mode"] == "fwd" else jax.grad(
        lambda q, k, v: jnp.sum(attn(q, k, v) * do), argnums=(0, 1, 2))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    if temp > case["mem_limit_gb"] * 2**30:
        return dict(case, temp_bytes=temp, compile_s=compile_s, skipped=f"temp {temp / 2**30:.1f} GiB > limit")
    hwm_ok = reset_hwm()
    rss0 = proc_kb("VmRSS")
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    rss = (proc_kb("VmHWM") - rss0) * 1024 if hwm_ok else -1
    return dict(case, seconds=statistics.median(times), temp_bytes=temp, rss_bytes=rss, compile_s=compile_s)


def run_case(case: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(case)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return dict(case, error=f"rc={proc.returncode}: {tail[0][:120]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(points) -> float | None:
    """Least-squares slope of log(seconds) against log(T)."""
    pts = [(math.log(t), math.log(s)) for t, s in points]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _fmt_s(r):
    return r.get("error") or ("not run" if "skipped" in r else f"{r['seconds']:.3f}")


def _mib(r):
    return "-" if "temp_bytes" not in r else f"{r['temp_bytes'] / 2**20:,.1f}"


def _rss(r):
    return "-" if r.get("rss_bytes", -1) < 0 else f"{r['rss_bytes'] / 2**20:,.1f}"


def _ratio(a, b):
    return f"{a['seconds'] / b['seconds']:.1f}x" if "seconds" in a and "seconds" in b else "-"


def table(results, args) -> str:
    out = [f"Self-attention B=1, N={args.heads}, H={args.head_dim}, fp32, CPU ({os.cpu_count()} cores); "
           f"sparse block {args.block}; blockwise = full (unmasked) attention, its default tiles.",
           "Time: median wall seconds per call, compile excluded. temp: XLA memory_analysis() temp MiB. "
           "rss: VmHWM - VmRSS around the timed calls, MiB.", ""]
    for wl in WORKLOADS:
        rows = [r for r in results if r["workload"] in (wl, "*")]
        if not any(r["workload"] == wl for r in rows):
            continue
        out += [f"### {wl}: {DESCRIBE[wl]}", "",
                "| T | pass | sparse s | dense s | blockwise s | dense/sparse | blockwise/sparse "
                "| sparse temp | dense temp | blockwise temp | sparse rss | dense rss | blockwise rss |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for T in sorted({r["T"] for r in rows}):
            for mode in MODES:
                get = {r["impl"]: r for r in rows if r["T"] == T and r["mode"] == mode}
                s, d, b = (get.get(i, {}) for i in IMPLS)
                out.append(f"| {T} | {mode} | {_fmt_s(s)} | {_fmt_s(d)} | {_fmt_s(b)} | {_ratio(d, s)} "
                           f"| {_ratio(b, s)} | {_mib(s)} | {_mib(d)} | {_mib(b)} | {_rss(s)} | {_rss(d)} | {_rss(b)} |")
        out += ["", "Scaling exponent of time vs T (least squares over the measured T):", "",
                "| pass | sparse | dense | blockwise |", "|---|---:|---:|---:|"]
        for mode in MODES:
            cells = []
            for impl in IMPLS:
                pts = [(r["T"], r["seconds"]) for r in rows if r["impl"] == impl and r["mode"] == mode
                       and "seconds" in r]
                e = slope(pts)
                cells.append("-" if e is None else f"{e:.2f} ({len(pts)} pts)")
            out.append(f"| {mode} | " + " | ".join(cells) + " |")
        top = max(r["T"] for r in rows)
        for mode in MODES:
            get = {r["impl"]: r for r in rows if r["T"] == top and r["mode"] == mode}
            s, d = get.get("sparse", {}), get.get("dense", {})
            out.append(f"\nAt T={top}, {mode}: sparse vs dense {_ratio(d, s)} faster (goal >= 8x)"
                       + (f", XLA temp {d['temp_bytes'] / max(s.get('temp_bytes', 1), 1):.0f}x smaller"
                          if "temp_bytes" in d and "temp_bytes" in s else "") + ".")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-t", type=int, default=16384, help="largest T (shrink for a quick run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64, help="sparse block size")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per case (halved above T=4096)")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="do not run a case whose XLA temp exceeds this")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    impls = args.impls.split(",")
    results = []
    for T in [t for t in TS if t <= args.max_t]:
        for mode in MODES:
            jobs = [(wl, impl) for wl in args.workloads.split(",") for impl in impls if impl != "blockwise"]
            if "blockwise" in impls:
                jobs.append(("*", "blockwise"))  # unmasked: the same for every workload
            for wl, impl in jobs:
                case = dict(workload=wl, impl=impl, T=T, mode=mode, heads=args.heads, head_dim=args.head_dim,
                            block=args.block, mem_limit_gb=args.mem_limit_gb,
                            repeats=args.repeats if T <= 4096 else max(1, args.repeats // 2))
                r = run_case(case)
                results.append(r)
                print(f"  {wl:<10} {impl:<9} T={T:>6} {mode:<8} {_fmt_s(r):>10} s  temp {_mib(r)} MiB "
                      f"rss {_rss(r)} MiB", file=sys.stderr, flush=True)
    text = table(results, args)
    print(text)
    if args.out:
        command = "python experiments/bench/sparse.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(f"# Sparse attention on CPU: block-sparse vs dense vs blockwise\n\n`{command.strip()}`\n\n"
                    f"{text}\n")


if __name__ == "__main__":
    main()
