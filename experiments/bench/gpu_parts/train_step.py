"""(d) a ``gpt2_small``-shaped bf16 train step: tokens/s and MFU, ``attention_impl`` pallas vs xla (see
``gpu_suite.py``)."""

from __future__ import annotations

from gpu_parts.common import D_WHEELS, Part, bench, normal, peak_bf16

import importlib.util
import math
import statistics
import time



# =========================================================================== (d) train step


def part_d(p: Part) -> None:
    missing = [m for m in ("pydantic", "flax", "optax", "jaxtyping") if importlib.util.find_spec(m) is None]
    if missing:
        p.line(f"Skipped: jaxformer.model needs {', '.join(missing)}, absent here. Carry these wheels (cp312, "
               f"manylinux x86_64) and put them on PYTHONPATH: " + "; ".join(D_WHEELS[m] for m in missing) + ".")
        p.finish("skipped", f"needs {' '.join(missing)}")
        return
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    try:
        from jaxformer.model import ModelConfig, abstract_init, count_params, flops_per_token, init, presets
        from jaxformer.model.config import merge
        from jaxformer.model.functional import apply
        from jaxformer.ops.losses import cross_entropy
    except Exception as e:  # noqa: BLE001 -- e.g. a flax too old for jaxformer
        p.line(f"Skipped: jaxformer.model does not import here: {p.error('import jaxformer.model', e)}")
        p.finish("skipped", "jaxformer.model does not import")
        return

    base = presets.gpt2_small().model_dump()
    if p.dry:
        B, T, steps = 2, 16, 2
        base = merge(base, dict(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=T))
    else:
        B, T, steps = 16, 1024, 10
    device = jax.devices()[0]
    peak = peak_bf16(device.device_kind)

    # the matmul peak measured here (bf16 8192^3 on the GPU; CPU: a small fp32 one)
    n_mm = 256 if p.dry else 8192
    mm_dtype = jnp.float32 if p.dry else jnp.bfloat16
    a, b = normal(20, (n_mm, n_mm), mm_dtype), normal(21, (n_mm, n_mm), mm_dtype)
    t_mm, _ = bench(jax.jit(lambda a, b: a @ b), a, b, dry=p.dry)
    mm_tflops = 2 * n_mm ** 3 / t_mm / 1e12
    del a, b
    p.line(f"gpt2_small shape: {base['n_layers']} layers, d_model {base['d_model']}, {base['attention']['n_heads']} heads, "
           f"vocab {base['vocab_size']}, B={B}, T={T}; params fp32, compute bf16, scan_layers, AdamW; "
           f"tokens/s from the median of {steps} steps after a warm-up (compile excluded). FLOPs: "
           "jaxformer.model.flops_per_token (6 * matmul params + 12 * T * d_attn per layer, attention counted "
           "in full). Peaks: datasheet dense bf16 "
           + (f"{peak:.0f} TFLOP/s ({device.device_kind})" if peak else f"unknown for {device.device_kind!r}")
           + f"; measured {n_mm}^3 {jnp.dtype(mm_dtype).name} matmul {mm_tflops:.1f} TFLOP/s."
           + (" Dry run: both steps are only traced." if p.tracing else ""))
    p.line("")
    p.line("| attention_impl | params | step ms | tokens/s | TFLOP/s | MFU (datasheet) | MFU (measured matmul) "
           "| loss (step 0) | compile s |")
    p.line("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    mfus = {}
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, base["vocab_size"])
    for impl in ("pallas", "xla"):
        if not p.room(impl):
            continue
        cfg = ModelConfig(**merge(base, {"compute_dtype": "bfloat16", "param_dtype": "float32", "attention_impl": impl,
                                         "scan_layers": True}))
        trace = p.tracing  # a dry run traces the step (a CPU compile of it would cost more than the rest of the part)
        try:
            def run():
                opt = optax.adamw(3e-4, weight_decay=0.1)
                if trace:  # abstract parameters: nothing is initialised or compiled
                    graphdef, state = abstract_init(cfg)
                    params = nnx.to_pure_dict(state)
                    opt_state = jax.eval_shape(opt.init, params)
                else:
                    graphdef, state = init(cfg, jax.random.key(0))
                    params = nnx.to_pure_dict(state)
                    opt_state = opt.init(params)

                def loss_fn(params, x, y):
                    return cross_entropy(apply(graphdef, params, x), y)[0]

                def step(params, opt_state, x, y):
                    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
                    updates, opt_state = opt.update(grads, opt_state, params)
                    return optax.apply_updates(params, updates), opt_state, loss

                step = jax.jit(step, donate_argnums=(0, 1))
                x, y = tokens[:, :-1], tokens[:, 1:]
                if trace:
                    jax.eval_shape(step, params, opt_state, x, y)
                    return count_params(cfg), math.nan, math.nan, math.nan
                t = time.perf_counter()
                params, opt_state, loss0 = step(params, opt_state, x, y)
                loss0 = float(loss0)
                compile_s = time.perf_counter() - t
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    params, opt_state, loss = step(params, opt_state, x, y)
                    jax.block_until_ready(loss)
                    times.append(time.perf_counter() - t)
                return count_params(cfg), statistics.median(times), loss0, compile_s

            n_params, sec, loss0, compile_s = p.case(run)
        except Exception as e:  # noqa: BLE001
            p.fails.append(f"{impl}: {p.error(impl, e)}")
            p.line(f"| {impl} | | error | | | | | | |")
            continue
        tps = B * T / sec
        flops = flops_per_token(cfg, T) * tps
        mfu = None if peak is None or math.isnan(flops) else flops / (peak * 1e12)
        mfus[impl] = mfu

        def f(x, spec):  # NaN: a dry run's traced step
            return "-" if x is None else ("traced" if math.isnan(x) else format(x, spec))

        p.line(f"| {impl} | {n_params / 1e6:.1f}M | {f(1e3 * sec, '.1f')} | {f(tps, ',.0f')} | {f(flops / 1e12, '.1f')} | "
               f"{f(mfu, '.1%')} | {f(flops / (mm_tflops * 1e12), '.1%')} | {f(loss0, '.3f')} | {f(compile_s, '.1f')} |")
    mfu = mfus.get("pallas")
    p.line("\nGoal (issue 16): train step MFU >= 45% (pallas): "
           + ("-" if mfu is None else f"{mfu:.1%}, {'met' if mfu >= 0.45 else 'NOT met'}"))
    p.finish(summary="MFU " + ", ".join(f"{k} {'-' if v is None else f'{v:.1%}'}" for k, v in mfus.items()))


