"""(b) flash attention TFLOP/s beside cuDNN, XLA and JAX's Pallas kernels (see ``gpu_suite.py``)."""

from __future__ import annotations

import math
import warnings

from gpu_parts.common import Part, bench, normal
from gpu_parts.correctness import dry_lowering



# =========================================================================== (b) attention TFLOP/s


def _attention_impls(dry: bool):
    """name -> callable(q, k, v, causal) or an error string (the anchor cannot be built here)."""
    import jax

    from pallas_kernels.flash_attention import flash_attention

    impls = {
        "ours": lambda q, k, v, c: flash_attention(q, k, v, causal=c, backend="gpu", interpret=dry),
        "cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn"),
        "xla": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla"),
    }
    try:  # deprecated in JAX 0.11 (in favour of tokamax) but still there; its signature is the same in 0.10 and 0.11
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as jax_triton_attention

        def jax_triton(q, k, v, c):
            return jax_triton_attention.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=c,
                                            interpret=dry)
        impls["jax-pallas-triton"] = jax_triton
    except Exception as e:  # noqa: BLE001
        impls["jax-pallas-triton"] = f"{type(e).__name__}: {e}"[:120]
    try:  # Mosaic GPU (Hopper): bf16/fp16, H % 64 == 0; its backward does not take causal
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention_mgpu

        def jax_mgpu(q, k, v, c):
            cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=c,
                                              block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
            return attention_mgpu.attention(q, k, v, cfg)
        impls["jax-pallas-mgpu"] = jax_mgpu
    except Exception as e:  # noqa: BLE001
        impls["jax-pallas-mgpu"] = f"{type(e).__name__}: {e}"[:120]
    return impls


def part_b(p: Part) -> None:
    import jax
    import jax.numpy as jnp

    impls = _attention_impls(p.dry)
    for name in p.skip & set(impls):
        impls[name] = "skipped (--skip)"
    names = list(impls)
    tokens, N = (128, 2) if p.dry else (16384, 16)
    hds = (16,) if p.dry else (128, 64)
    Ts = (32,) if p.dry else (8192, 2048)
    p.line(f"bf16, N={N} heads (MHA), B*T = {tokens} tokens. TFLOP/s: forward 4*B*N*T*S*H (x0.5 causal), "
           "forward+backward 3.5x that (FlashAttention's convention); median of 3 repeats of back-to-back calls, "
           "compile excluded. '-': not run or failed (first error below the table)."
           + (" Dry run: the first row runs (interpret mode), the rest are only traced." if p.tracing else ""))
    for name, impl in impls.items():
        if isinstance(impl, str):
            p.line(f"- {name}: not available here: {impl}")
    if p.dry:  # the Pallas calls at the GPU's largest shape, lowered for CUDA (cuDNN and Mosaic GPU need a GPU)
        spec = jax.ShapeDtypeStruct((2, 8192, 16, 128), jnp.bfloat16)
        for name in ("ours", "jax-pallas-triton"):
            if not isinstance(impls[name], str):
                impl = _attention_impls(False)[name]  # compiled, not interpreted
                dry_lowering(p, f"{name} fwd+bwd, H=128 T=8192 causal", jax.grad(
                    lambda q, k, v, impl=impl: jnp.sum(impl(q, k, v, True).astype(jnp.float32)), argnums=(0, 1, 2)),
                    spec, spec, spec)
    p.line("")
    p.line("| H | causal | T | B | pass | " + " | ".join(names) + " | ours/cudnn | ours/jax-pallas-triton |")
    p.line("|---:|---|---:|---:|---|" + "---:|" * (len(names) + 2))
    errors: dict[str, str] = {}
    results = {}
    for T in Ts:  # 8k first (the goals' length), both head dims, then 2k
        for H in hds:
            for causal in (True, False):
                B = max(1, tokens // T)
                q, k, v, do = (normal(i, (B, T, N, H), jnp.bfloat16) for i in range(4))
                flops = 4 * B * N * T * T * H * (0.5 if causal else 1.0)
                for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                    label = f"H={H} T={T} causal={causal} {mode}"
                    if not p.room(label):
                        continue
                    trace = p.tracing and bool(results)

                    def measure_row():
                        row = {}
                        for name, impl in impls.items():
                            if isinstance(impl, str):
                                row[name] = None
                                continue
                            if mode == "fwd":
                                fn = jax.jit(lambda q, k, v, impl=impl: impl(q, k, v, causal))
                            else:
                                fn = jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
                                    impl(q, k, v, causal).astype(jnp.float32) * do.astype(jnp.float32)),
                                    argnums=(0, 1, 2)))
                            try:
                                sec, first = bench(fn, q, k, v, dry=p.dry, trace=trace)
                                row[name] = flops * mult / sec / 1e12
                                p.console(f"    {label} {name}: {row[name]:.1f} TFLOP/s, {1e3 * sec:.3f} ms "
                                          f"(first call {first:.1f} s)")
                            except Exception as e:  # noqa: BLE001 -- an anchor may not take a shape or run here
                                row[name] = None
                                msg = p.error(f"{name} {label}", e)
                                errors.setdefault(name, f"{label}: {msg}")
                                if name == "ours":
                                    p.fails.append(f"ours {label}: {msg}")
                        return row

                    row = results[(H, T, causal, mode)] = p.case(measure_row)

                    def f(x):
                        return "-" if x is None else ("traced" if math.isnan(x) else f"{x:.1f}")

                    def r(a, b):
                        return "-" if a is None or b is None or math.isnan(a / b) else f"{a / b:.2f}"

                    p.line(f"| {H} | {causal} | {T} | {B} | {mode} | " + " | ".join(f(row[n]) for n in names)
                           + f" | {r(row['ours'], row['cudnn'])} | {r(row['ours'], row['jax-pallas-triton'])} |")
    if errors:
        p.line("\nFirst error of each implementation:")
        for name, msg in errors.items():
            p.line(f"- {name}: {msg}")
    # goals (recorded, not asserted): at the longest T and largest H
    H, T = hds[0], Ts[0]
    lines = []
    for causal in (True, False):
        fwd, fb = results.get((H, T, causal, "fwd"), {}), results.get((H, T, causal, "fwd+bwd"), {})

        def ratio(row, other):
            a, b = row.get("ours"), row.get(other)
            return None if a is None or b is None or math.isnan(a / b) else a / b

        for what, x, goal in (("fwd ours/cudnn", ratio(fwd, "cudnn"), 0.7),
                              ("fwd+bwd ours/cudnn", ratio(fb, "cudnn"), 0.6),
                              ("fwd ours/jax-pallas-triton", ratio(fwd, "jax-pallas-triton"), 1.0),
                              ("fwd+bwd ours/jax-pallas-triton", ratio(fb, "jax-pallas-triton"), 1.0)):
            mark = "-" if x is None else (f"{x:.2f} {'met' if x >= goal else 'NOT met'}")
            lines.append(f"- H={H} T={T} causal={causal} {what} >= {goal}: {mark}")
    p.line("\nGoals (issue 16):\n" + "\n".join(lines))
    p.finish(summary=f"{len(results)} rows")


