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
import subprocess
import sys

from procmem import proc_kb, reset_hwm
from timing import median_seconds, timed

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
    compiled, compile_s = timed(lambda: jax.jit(fn).lower(q, k, v).compile())
    temp = compiled.memory_analysis().temp_size_in_bytes
    if temp > case["mem_limit_gb"] * 2**30:
        return dict(case, temp_bytes=temp, compile_s=compile_s, skipped=f"temp {temp / 2**30:.1f} GiB > limit")
    hwm_ok = reset_hwm()
    rss0 = proc_kb("VmRSS")
    seconds = median_seconds(compiled, q, k, v, repeats=case["repeats"])
    rss = (proc_kb("VmHWM") - rss0) * 1024 if hwm_ok else -1
    return dict(case, seconds=seconds, temp_bytes=temp, rss_bytes=rss, compile_s=compile_s)


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


def run_gpu(args) -> str:
    """Pallas block-sparse kernel vs cuDNN (and XLA) given the same mask as an explicit dense matrix.

    Correctness first: at T=1000 the kernel's forward and gradients must match ``xla_attention``
    on the device (bf16 tolerance), else the run aborts. Then bf16, N=16, H=64, B*T=16k tokens.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxformer.ops.attention import dot_product_attention, xla_attention

    def fwd_bwd(fn):
        def go(q, k, v, do):
            o, vjp = jax.vjp(fn, q, k, v)
            return (o, *vjp(do))
        return jax.jit(go)

    rng = np.random.default_rng(0)
    for wl in WORKLOADS:
        mask = make_mask(wl)
        q, k, v, do = (jnp.asarray(rng.standard_normal((1, 1000, 4, 64)), jnp.bfloat16) for _ in range(4))
        got = fwd_bwd(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="pallas"))(q, k, v, do)
        want = fwd_bwd(lambda q, k, v: xla_attention(q, k, v, mask=mask))(q, k, v, do)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            err = float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max()))
            if not np.isfinite(a).all() or err > 5e-2:
                raise SystemExit(f"GPU correctness failed: {wl} {name} rel err {err:.3g}")
    print("GPU correctness: ok", file=sys.stderr, flush=True)

    out = [f"bf16, N=16 heads, H=64, B*T = 16384 tokens, {jax.devices()[0].device_kind}; median seconds, "
           "compile excluded. cuDNN and XLA get the same mask as a dense [B, 1, T, S] boolean.", "",
           "| workload | T | pass | ours (pallas block-sparse) s | cuDNN masked s | XLA masked s | cuDNN/ours | XLA/ours |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for wl in WORKLOADS:
        mask = make_mask(wl)
        for T in [t for t in (4096, 8192, 16384) if t <= args.max_t]:
            B = max(1, 16384 // T)
            q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, 16, 64)), jnp.bfloat16) for _ in range(4))
            dense = jnp.broadcast_to(mask.dense(T, T)[:, None], (B, 1, T, T))
            impls = {
                "ours": lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="pallas"),
                "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn"),
                "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla"),
            }
            for mode in MODES:
                secs = {}
                for name, fn in impls.items():
                    f = jax.jit(fn) if mode == "fwd" else fwd_bwd(fn)
                    a = (q, k, v) if mode == "fwd" else (q, k, v, do)
                    try:
                        secs[name] = median_seconds(f, *a, repeats=args.repeats)
                    except Exception as e:  # noqa: BLE001 -- a baseline may not support a mask or shape
                        secs[name] = None
                        print(f"  {name} {wl} T={T} {mode}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                o, c, x = (secs.get(n) for n in ("ours", "cudnn", "xla"))
                f3 = lambda t: "-" if t is None else f"{t:.4f}"  # noqa: E731
                r = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
                out.append(f"| {wl} | {T} | {mode} | {f3(o)} | {f3(c)} | {f3(x)} | {r(c, o)} | {r(x, o)} |")
                print("  " + out[-1], file=sys.stderr, flush=True)
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
    ap.add_argument("--part", choices=("cpu", "gpu"), default="cpu",
                    help="gpu: the Pallas block-sparse kernel vs cuDNN with an explicit mask (needs a GPU)")
    ap.add_argument("--gpu-out", default=os.path.join(ROOT, "experiments", "results", "sparse_gpu.md"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part == "gpu":
        text = run_gpu(args)
        print(text)
        with open(args.gpu_out, "w") as f:
            f.write(f"# Sparse attention on GPU: Pallas block-sparse vs cuDNN with a mask\n\n"
                    f"`python experiments/bench/sparse.py --part gpu`\n\n{text}\n")
        return
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
