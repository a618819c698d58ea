"""Attention benchmark: dense XLA vs blockwise on CPU; our Pallas kernel vs cuDNN / XLA / JAX's Pallas on GPU.

CPU part (always): causal attention, B=1, fp32, forward and forward+backward, at
T = S = 1k .. 16k. Every case runs in a fresh subprocess; compile is excluded
from the time (median of timed runs after one warm-up). Memory, two ways:

* ``temp``: XLA's compiled ``memory_analysis().temp_size_in_bytes`` -- the
  scratch the program needs beyond its inputs and outputs ("extra memory");
* ``rss``: the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after compiling) minus the resident set before the
  warm-up and timed runs.

GPU part (only when ``jax.default_backend() == "gpu"``): correctness of
``flash_attention`` on the device first (aborts on mismatch), then TFLOP/s of
forward and forward+backward for bf16, head dim 64 and 128, T = 1k .. 16k,
causal and not, against ``jax.nn.dot_product_attention`` (xla, cudnn) and
``jax.experimental.pallas.ops.gpu.attention.mha``; the table goes to
``experiments/results/attention_gpu.md``.

    python experiments/bench/attention.py                 # CPU table (+ GPU when present)
    python experiments/bench/attention.py --quick         # T = 1k, 2k
    python experiments/bench/attention.py --max-t 4096 --out experiments/results/attention_cpu.md
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
CPU_TS = (1024, 2048, 4096, 8192, 16384)


# --------------------------------------------------------------------------- CPU worker


def cpu_worker(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxformer.ops import MaskSpec, xla_attention
    from jaxformer.ops.blockwise import blockwise_attention

    T, N, H = case["T"], case["heads"], case["head_dim"]
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, T, N, H), np.float32)) for _ in range(4))
    mask = MaskSpec(causal=True)
    if case["impl"] == "xla":
        attn = lambda q, k, v: xla_attention(q, k, v, mask=mask)  # noqa: E731
    else:
        attn = lambda q, k, v: blockwise_attention(  # noqa: E731
            q, k, v, mask=mask, block_k=case["block_k"], block_q=case["block_q"])
    if case["mode"] == "fwd":
        fn = attn
    else:
        fn = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * do), argnums=(0, 1, 2))
    compiled, compile_s = timed(lambda: jax.jit(fn).lower(q, k, v).compile())
    temp = compiled.memory_analysis().temp_size_in_bytes
    hwm_ok = reset_hwm()
    rss0 = proc_kb("VmRSS")
    seconds = median_seconds(compiled, q, k, v, repeats=case["repeats"])
    rss_peak = (proc_kb("VmHWM") - rss0) * 1024 if hwm_ok else -1
    return dict(case, seconds=seconds, temp_bytes=temp, rss_bytes=rss_peak, compile_s=compile_s)


def run_cpu(args) -> str:
    Ts = [t for t in ((1024, 2048) if args.quick else CPU_TS) if t <= args.max_t]
    rows = []
    for T in Ts:
        for mode in ("fwd", "fwd+bwd"):
            res = {}
            for impl in ("xla", "blockwise"):
                case = dict(impl=impl, T=T, mode=mode, heads=args.heads, head_dim=args.head_dim,
                            block_k=args.block_k, block_q=args.block_q,
                            repeats=args.repeats if T <= 4096 else max(1, args.repeats // 2))
                proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case)],
                                      capture_output=True, text=True, cwd=ROOT,
                                      env=dict(os.environ, JAX_PLATFORMS="cpu"))
                if proc.returncode != 0:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                    res[impl] = dict(case, error=f"rc={proc.returncode}: {tail[0][:120]}")
                else:
                    res[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"  T={T:>6} {mode:<8} {impl:<9} " + (
                    res[impl].get("error") or
                    f"{res[impl]['seconds']:8.3f}s temp {res[impl]['temp_bytes'] / 2**20:9.1f} MiB "
                    f"rss {res[impl]['rss_bytes'] / 2**20:9.1f} MiB"), file=sys.stderr, flush=True)
            rows.append((T, mode, res))
    return cpu_table(rows, args)


def _mib(x):
    return f"{x / 2**20:,.1f}"


def cpu_table(rows, args) -> str:
    out = [
        f"Causal self-attention, B=1, N={args.heads}, H={args.head_dim}, fp32, CPU "
        f"({os.cpu_count()} cores); blockwise block_k={args.block_k}, "
        f"block_q={args.block_q or min(args.block_k, 256)}.",
        "Time: median wall seconds per call, compile excluded. temp: XLA memory_analysis() temp bytes "
        "(extra memory beyond inputs/outputs). rss: VmHWM - VmRSS around the warm-up and timed calls (after compile).",
        "",
        "| T | pass | xla s | blockwise s | speed-up (xla/bw) | xla temp MiB | bw temp MiB | temp ratio "
        "| xla rss MiB | bw rss MiB | rss ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for T, mode, res in rows:
        x, b = res["xla"], res["blockwise"]
        if "error" in x or "error" in b:
            out.append(f"| {T} | {mode} | {x.get('error') or round(x['seconds'], 3)} | "
                       f"{b.get('error') or round(b['seconds'], 3)} | | | | | | | |")
            continue
        tr = x["temp_bytes"] / max(b["temp_bytes"], 1)
        rr = x["rss_bytes"] / max(b["rss_bytes"], 1) if b["rss_bytes"] > 0 else float("nan")
        out.append(
            f"| {T} | {mode} | {x['seconds']:.3f} | {b['seconds']:.3f} | {x['seconds'] / b['seconds']:.2f}x "
            f"| {_mib(x['temp_bytes'])} | {_mib(b['temp_bytes'])} | {tr:.1f}x "
            f"| {_mib(x['rss_bytes'])} | {_mib(b['rss_bytes'])} | {rr:.1f}x |")
    return "\n".join(out)


# --------------------------------------------------------------------------- GPU part


def _gpu_correctness() -> list[str]:
    """flash_attention vs reference on the device, forward and gradients; returns failure messages."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import flash_attention, reference

    fails = []
    cases = [
        (jnp.float32, (2, 200, 200, 4, 2, 64), dict(causal=True), 1e-4),
        (jnp.bfloat16, (2, 333, 333, 8, 2, 128), dict(causal=True, window=(100, None),
                                                       alibi_slopes=jnp.linspace(0.01, 0.1, 8)), 3e-2),
        (jnp.bfloat16, (1, 128, 700, 4, 4, 64), dict(softcap=30.0, kv_lengths=jnp.array([650])), 3e-2),
        (jnp.float16, (2, 256, 256, 4, 1, 80),
         dict(causal=True, q_segment_ids=jnp.array([[0] * 100 + [1] * 156] * 2),
              kv_segment_ids=jnp.array([[0] * 100 + [1] * 156] * 2)), 2e-2),
    ]
    for dtype, (B, T, S, N, K, H), kw, tol in cases:
        rng = np.random.default_rng(0)
        q, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), dtype) for _ in range(2))

        def fwd_bwd(fn, q, k, v, do):
            o, vjp = jax.vjp(fn, q, k, v)
            return (o, *vjp(do))

        got = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: flash_attention(q, k, v, backend="gpu", **kw), *a))(
            q, k, v, do)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        want = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: reference(q, k, v, **kw), *a))(*f32)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            err = float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max()))
            if not np.isfinite(a).all() or err > tol:
                fails.append(f"{dtype.__name__} {(B, T, S, N, K, H)} {sorted(kw)} {name}: rel err {err:.3g}")
    return fails


def run_gpu(args) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas_attention

    from pallas_kernels.flash_attention import flash_attention

    fails = _gpu_correctness()
    if fails:
        raise SystemExit("GPU correctness check failed:\n" + "\n".join(fails))
    print("GPU correctness: ok", file=sys.stderr, flush=True)

    Ts = [t for t in ((1024, 4096, 16384) if args.quick else CPU_TS) if t <= args.max_t]
    tokens, N = 16384, 16
    impls = {
        "ours": lambda q, k, v, c: flash_attention(q, k, v, causal=c, backend="gpu"),
        "cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn"),
        "xla": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla"),
        "jax-pallas": lambda q, k, v, c: jax_pallas_attention.mha(q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]),
                                                                  causal=c),
    }
    rows = []
    for H in (64, 128):
        for causal in (False, True):
            for T in Ts:
                B = max(1, tokens // T)
                rng = np.random.default_rng(0)
                q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(4))
                flops = 4 * B * N * T * T * H * (0.5 if causal else 1.0)
                row = dict(H=H, causal=causal, T=T, B=B)
                for name, impl in impls.items():
                    fwd = jax.jit(lambda q, k, v, impl=impl: impl(q, k, v, causal))
                    bwd = jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
                        impl(q, k, v, causal).astype(jnp.float32) * do), argnums=(0, 1, 2)))
                    for mode, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", bwd, 3.5)):
                        try:
                            sec = median_seconds(fn, q, k, v, repeats=args.repeats)
                            row[(name, mode)] = flops * mult / sec / 1e12
                        except Exception as e:  # noqa: BLE001 -- a baseline may not support a shape
                            row[(name, mode)] = None
                            print(f"  {name} {mode} T={T} H={H}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                rows.append(row)
                print("  " + " ".join(f"{k}={v}" if not isinstance(k, tuple) else
                                      f"{k[0]}/{k[1]}={v and round(v, 1)}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
    return gpu_table(rows, jax.devices()[0].device_kind)


def gpu_table(rows, device) -> str:
    def f(x):
        return "-" if x is None else f"{x:.1f}"

    def r(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}"

    out = [f"bf16, N=16 heads, B*T = 16384 tokens, {device}. TFLOP/s: forward 4*B*N*T*S*H (x0.5 causal), "
           "forward+backward 3.5x that.", "",
           "| H | causal | T | pass | ours | cuDNN | XLA | JAX Pallas mha | ours/cuDNN | ours/JAX Pallas |",
           "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        for mode in ("fwd", "fwd+bwd"):
            o, c, x, p = (row.get((n, mode)) for n in ("ours", "cudnn", "xla", "jax-pallas"))
            out.append(f"| {row['H']} | {row['causal']} | {row['T']} | {mode} | {f(o)} | {f(c)} | {f(x)} | {f(p)} "
                       f"| {r(o, c)} | {r(o, p)} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths")
    ap.add_argument("--max-t", type=int, default=16384)
    ap.add_argument("--part", choices=("auto", "cpu", "gpu"), default="auto",
                    help="auto: CPU part, plus the GPU part when a GPU is the default backend")
    ap.add_argument("--heads", type=int, default=1, help="CPU part: query (= kv) heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-k", type=int, default=512, help="CPU part: blockwise kv tile")
    ap.add_argument("--block-q", type=int, default=None, help="CPU part: blockwise q tile (default block-k)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="CPU part: also write the table (markdown) here")
    ap.add_argument("--gpu-out", default=os.path.join(ROOT, "experiments", "results", "attention_gpu.md"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print(json.dumps(cpu_worker(json.loads(args.worker))))
        return

    import jax

    backend = jax.default_backend()
    command = "python experiments/bench/attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.part in ("auto", "cpu"):
        table = run_cpu(args)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"# Attention on CPU: dense XLA vs blockwise\n\n`{command.strip()}`\n\n{table}\n")
    if args.part == "gpu" or (args.part == "auto" and backend == "gpu"):
        if backend != "gpu":
            raise SystemExit(f"--part gpu needs a GPU; jax.default_backend()={backend!r}")
        table = run_gpu(args)
        print(table)
        os.makedirs(os.path.dirname(args.gpu_out), exist_ok=True)
        with open(args.gpu_out, "w") as f:
            f.write(f"# Attention on GPU: TFLOP/s\n\n`{command.strip()}`\n\n{table}\n")


if __name__ == "__main__":
    main()
