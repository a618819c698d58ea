"""(a) correctness on the device: the flash kernels (forward, dq, dk/dv), the block-sparse path and paged
decode against the package's own oracles (see ``gpu_suite.py``)."""

from __future__ import annotations

from gpu_parts.common import Part, normal, rel_err, to_f32

import math
import time



# =========================================================================== (a) correctness


def _flash_cases(dry: bool):
    """``(name, dtype, (B, T, S, N, K, H), kwargs builder)``; the builder gets the dims."""
    import jax.numpy as jnp
    import numpy as np

    def alibi(N):
        return jnp.asarray(2.0 ** (-8.0 * (np.arange(N) + 1) / N), jnp.float32)

    def segments(B, T):
        # ragged documents: boundaries differ per sequence
        ids = np.stack([np.searchsorted(np.sort(np.random.default_rng(b).integers(1, T, 2)), np.arange(T), "right")
                        for b in range(B)])
        return jnp.asarray(ids, jnp.int32)

    f32, bf16 = jnp.float32, jnp.bfloat16
    d = dry
    return [  # the first runs in a dry run (the rest are traced): it has every feature
        ("all: window+ALiBi+softcap+segments+ragged", bf16, (2, 40, 40, 4, 2, 16) if d else (2, 384, 384, 8, 2, 64),
         lambda B, T, S, N: dict(causal=True, window=(T // 2, 0), alibi_slopes=alibi(N), softcap=20.0,
                                 q_segment_ids=segments(B, T), kv_segment_ids=segments(B, S),
                                 kv_lengths=jnp.asarray([S, S * 4 // 5][:B], jnp.int32))),
        ("causal GQA", f32, (1, 40, 40, 4, 2, 16) if d else (2, 256, 256, 8, 2, 64),
         lambda B, T, S, N: dict(causal=True)),
        ("causal hd128", bf16, (1, 48, 48, 2, 2, 32) if d else (2, 512, 512, 8, 8, 128),
         lambda B, T, S, N: dict(causal=True)),
        ("window+ALiBi GQA", bf16, (1, 45, 45, 4, 2, 32) if d else (2, 333, 333, 8, 2, 128),
         lambda B, T, S, N: dict(causal=True, window=(T // 3, 0), alibi_slopes=alibi(N))),
        ("softcap, ragged kv, T<S", bf16, (2, 20, 50, 2, 2, 16) if d else (2, 128, 700, 4, 4, 64),
         lambda B, T, S, N: dict(softcap=30.0, kv_lengths=jnp.asarray([S, S * 3 // 5], jnp.int32))),
        ("segments causal MQA", f32, (2, 40, 40, 2, 1, 16) if d else (2, 300, 300, 4, 1, 64),
         lambda B, T, S, N: dict(causal=True, q_segment_ids=segments(B, T), kv_segment_ids=segments(B, S))),
        ("bidir window+ALiBi[B,N] hd80", f32, (2, 36, 36, 2, 1, 24) if d else (2, 200, 200, 4, 2, 80),
         lambda B, T, S, N: dict(window=(T // 4, T // 4),
                                 alibi_slopes=jnp.stack([alibi(N), 0.5 * alibi(N)])[:B])),
        ("causal hd256", bf16, (1, 32, 32, 2, 2, 32) if d else (1, 256, 256, 4, 4, 256),
         lambda B, T, S, N: dict(causal=True)),
    ]


def _dense_masked(q, k, v, allowed):
    """Softmax attention with a dense bool ``allowed [1|N, T, S]`` (fp32, HIGHEST); empty rows give 0.

    The block-sparse oracle, written from the definition (no helper of the kernels)."""
    import jax
    import jax.numpy as jnp

    N, K, H = q.shape[2], k.shape[2], q.shape[3]
    kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, kr, precision=jax.lax.Precision.HIGHEST) / math.sqrt(H)
    ok = jnp.broadcast_to(jnp.asarray(allowed)[None], s.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(ok, jnp.exp(jnp.where(ok, s - m, 0.0)), 0.0)
    z = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("BNTS,BSNH->BTNH", e / jnp.where(z > 0, z, 1.0), vr, precision=jax.lax.Precision.HIGHEST)


def _block_reduce(allowed, bq: int, bk: int):
    """bool ``[Nh, T, S]`` -> ``[Nh, ceil(T/bq), ceil(S/bk)]``: tiles holding any allowed element."""
    import numpy as np

    nh, T, S = allowed.shape
    nq, nk = -(-T // bq), -(-S // bk)
    pad = np.zeros((nh, nq * bq, nk * bk), bool)
    pad[:, :T, :S] = allowed
    return pad.reshape(nh, nq, bq, nk, bk).any(axis=(2, 4))


def _sparse_cases(dry: bool):
    """``(name, dtype, dims, build)``: build(dims) -> (flash kwargs, allowed [Nh, T, S])."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import BlockSizes

    def longformer_bigbird(B, T, S, N):
        # window (w, w) + global tokens (rows and columns) + R-wide random key blocks per R-row query block
        rng = np.random.default_rng(0)
        w, R = max(2, T // 16), (8 if dry else 64)
        qg = np.zeros(T, bool)
        qg[[0, T // 2]] = True
        kg = np.zeros(S, bool)
        kg[[1, S // 3]] = True
        nqb, nkb = -(-T // R), -(-S // R)
        starts = (rng.integers(0, nkb, size=(1, 2, nqb)) * R).astype(np.int32)
        rows = np.repeat(starts, R, axis=-1)[..., :T]  # [1, r, T]
        qpos, kpos = np.arange(T)[:, None] + (S - T), np.arange(S)[None, :]
        rand = ((kpos[None] >= rows[0][:, :, None]) & (kpos[None] < rows[0][:, :, None] + R)).any(0)
        allowed = ((kpos >= qpos - w) & (kpos <= qpos + w)) | qg[:, None] | kg[None, :] | rand
        allowed = allowed[None]
        kw = dict(window=(w, w), block_map=lambda bq, bk: _block_reduce(allowed, bq, bk),
                  q_global=jnp.asarray(qg[None]), kv_global=jnp.asarray(kg[None]),
                  random_kv_starts=jnp.asarray(rows), random_block_size=R)
        return kw, allowed

    def tile_map(B, T, S, N):
        # a per-head map of whole tiles, no window: the kernel must attend exactly inside the listed tiles
        b = 16 if dry else 64
        rng = np.random.default_rng(1)
        live = rng.random((N, -(-T // b), -(-S // b))) < 0.5
        live[0, 0] = False  # an empty q block: zero rows and gradients
        live[-1, :, 0] = True
        allowed = np.kron(live, np.ones((b, b), bool))[:, :T, :S]
        kw = dict(block_map=lambda bq, bk: live, block_sizes=BlockSizes(b, b, b, b, b, b))
        return kw, allowed

    return [
        ("block-sparse Longformer+BigBird GQA", jnp.bfloat16, (1, 48, 48, 2, 1, 16) if dry else (2, 512, 512, 4, 2, 64),
         longformer_bigbird),
        ("block-sparse per-head tile map", jnp.float32, (1, 40, 48, 2, 1, 16) if dry else (1, 256, 320, 4, 2, 64),
         tile_map),
    ]


def _paged_cases(dry: bool):
    """``(name, dtype, (B, N, K, H, L, M), lengths, kwargs)``."""
    import jax.numpy as jnp

    bf16, f32 = jnp.bfloat16, jnp.float32
    if dry:
        return [
            ("paged GQA ragged", bf16, (3, 4, 1, 16, 16, 4), [64, 1, 0], {}),
            ("paged ALiBi+softcap+window", f32, (2, 4, 2, 16, 16, 4), [50, 17],
             dict(alibi_slopes=jnp.asarray([0.1, 0.05, 0.02, 0.01]), softcap=25.0, window=20)),
            ("paged MQA, 3 pages/split", bf16, (2, 4, 1, 16, 16, 5), [80, 33], dict(pages_per_split=3)),
        ]
    return [
        ("paged GQA 4:1 ragged", bf16, (8, 32, 8, 128, 16, 64), [1024, 1, 0, 17, 500, 1023, 16, 777], {}),
        ("paged ALiBi+softcap+window", f32, (4, 8, 2, 64, 16, 32), [512, 300, 45, 1],
         dict(alibi_slopes=jnp.asarray(2.0 ** -jnp.arange(1, 9, dtype=jnp.float32)), softcap=25.0, window=100)),
        ("paged MQA, 3 pages/split", bf16, (4, 8, 1, 64, 16, 40), [640, 639, 200, 48], dict(pages_per_split=3)),
    ]


def lower_for_cuda(fn, *args) -> int:
    """Lower ``jax.jit(fn)`` for CUDA on this (CPU) machine, as for an H200; returns the Triton kernel calls.

    The Pallas Triton lowering runs in full (JAX 0.11 asks the device for its compute capability:
    an abstract H200 answers), so a kernel Triton cannot lower fails here rather than on the GPU.
    """
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                      platform="gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("xla.gpu.triton")


def dry_lowering(p: Part, label: str, fn, *specs) -> None:
    """A dry run's check that ``fn`` lowers for CUDA at a GPU size (one line; a failure of ours fails the part)."""
    try:
        p.line(f"- CUDA lowering, {label}: ok ({lower_for_cuda(fn, *specs)} Triton kernels)")
    except Exception as e:  # noqa: BLE001
        msg = p.error(f"CUDA lowering {label}", e)
        p.line(f"- CUDA lowering, {label}: **FAIL** {msg}")
        if label.startswith("ours"):
            p.fails.append(f"CUDA lowering {label}: {msg}")


# fp32 kernels run their dots at HIGHEST (flash) but the paged kernel's dots carry no precision, which
# Triton may run as TF32: its fp32 tolerance is looser. bf16: inputs rounded to bf16, oracle in fp32.
TOL = {"float32": (1e-4, 1e-3), "bfloat16": (2e-2, 5e-2)}
TOL_PAGED = {"float32": 5e-3, "bfloat16": 2e-2}


def _dry_mode(tracing: bool, i: int, first: str = "run") -> str:
    """How a dry run treats case ``i`` of a list: the first one ``first`` ("run": fwd + bwd, "fwd"), the
    rest traced only (``jax.eval_shape``: arguments, shapes and the kernels' Python are checked, nothing
    compiled); on the device (and with --full) every case runs."""
    if not tracing:
        return "run"
    return first if i == 0 else "trace"


def part_a(p: Part) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import flash_attention, reference
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

    interp = p.dry
    (f32_fwd, f32_grad), (bf16_fwd, bf16_grad) = TOL["float32"], TOL["bfloat16"]
    p.line("Relative error max|got - want| / max(1, max|want|) of out, dq, dk, dv (fp32 oracle on the same "
           f"inputs); tolerances fwd/grad: fp32 {f32_fwd:g}/{f32_grad:g}, bf16 {bf16_fwd:g}/{bf16_grad:g}; paged "
           f"fp32 {TOL_PAGED['float32']:g}, bf16 {TOL_PAGED['bfloat16']:g}. Seconds: compile + first run of both."
           + (" Dry run: the first case of each list runs (interpret mode), the rest are only traced." if p.tracing
              else ""))
    if p.dry:
        p.line("cuda: the case at its GPU size (the suite's non-dry dims) lowered for CUDA on this CPU, compiled "
               "kernels for an abstract H200 (Triton kernel calls in the program).")
    p.line("")
    p.line("| case | dtype | B,T,S,N,K,H | out | dq | dk | dv | ok | s |" + (" cuda |" if p.dry else ""))
    p.line("|---|---|---|---:|---:|---:|---:|---|---:|" + ("---|" if p.dry else ""))

    def cuda_cell(name, fn, *args) -> str:
        """A dry run's lowering check of the compiled (not interpreted) kernel."""
        if not p.dry:
            return ""
        try:
            return f" {lower_for_cuda(fn, *args)} kernels |"
        except Exception as e:  # noqa: BLE001
            p.fails.append(f"{name}: does not lower for CUDA: {p.error(name + ' (cuda lowering)', e)}")
            return " **FAIL** |"

    def fwd_bwd(fn, mode):
        def run(q, k, v, do):
            if mode == "fwd":
                return (fn(q, k, v),)
            o, vjp = jax.vjp(fn, q, k, v)
            return (o, *vjp(do))
        return jax.jit(run)

    def gpu_specs(dtype, dims):
        B, T, S, N, K, H = dims
        return [jax.ShapeDtypeStruct(shape, dtype) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))]

    def check(name, dtype, dims, kw, oracle, mode, gpu=None):
        B, T, S, N, K, H = dims
        q, do = normal(1, (B, T, N, H), dtype), normal(2, (B, T, N, H), dtype)
        k, v = normal(3, (B, S, K, H), dtype), normal(4, (B, S, K, H), dtype)
        f32 = to_f32(q, k, v, do)
        kernel = fwd_bwd(lambda q, k, v: flash_attention(q, k, v, backend="gpu", interpret=interp, **kw), mode)
        cuda = "" if gpu is None else cuda_cell(
            name, fwd_bwd(lambda q, k, v: flash_attention(q, k, v, backend="gpu", **gpu[1]), "run"),
            *gpu_specs(dtype, gpu[0]))
        t = time.perf_counter()
        if mode == "trace":
            jax.eval_shape(kernel, q, k, v, do)
            jax.eval_shape(fwd_bwd(oracle, mode), *f32)
            p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | traced | | | | | "
                   f"{time.perf_counter() - t:.1f} |{cuda}")
            return
        got = jax.block_until_ready(kernel(q, k, v, do))
        want = fwd_bwd(oracle, mode)(*f32)
        secs = time.perf_counter() - t
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        tf, tg = TOL[jnp.dtype(dtype).name]
        ok = errs[0] <= tf and all(e <= tg for e in errs[1:])
        if not ok:
            p.fails.append(f"{name} ({jnp.dtype(dtype).name}): errors {', '.join(f'{e:.2e}' for e in errs)}")
        cells = [f"{e:.1e}" for e in errs] + ["-"] * (4 - len(errs))
        p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | " + " | ".join(cells)
               + f" | {'ok' if ok else '**FAIL**'} | {secs:.1f} |{cuda}")

    def failed(name, dtype, dims, e):
        p.fails.append(f"{name}: {p.error(name, e)}")
        p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | error | | | | **FAIL** | |"
               + (" |" if p.dry else ""))

    on_gpu = _flash_cases(False)
    for i, (name, dtype, dims, build) in enumerate(_flash_cases(p.dry)):
        if not p.room(name):
            continue
        B, T, S, N = dims[:4]
        try:
            kw = build(B, T, S, N)
            gpu = (on_gpu[i][2], build(*on_gpu[i][2][:4])) if p.dry else None
            p.case(check, name, dtype, dims, kw, lambda q, k, v, kw=kw: reference(q, k, v, **kw), _dry_mode(p.tracing, i),
                   gpu)
        except Exception as e:  # noqa: BLE001 -- report and go on
            failed(name, dtype, dims, e)

    on_gpu = _sparse_cases(False)
    for i, (name, dtype, dims, build) in enumerate(_sparse_cases(p.dry)):
        if not p.room(name):
            continue
        B, T, S, N = dims[:4]
        try:
            kw, allowed = build(B, T, S, N)
            gpu = (on_gpu[i][2], on_gpu[i][3](*on_gpu[i][2][:4])[0]) if p.dry else None
            p.case(check, name, dtype, dims, kw, lambda q, k, v, a=allowed: _dense_masked(q, k, v, a),
                   _dry_mode(p.tracing, i, "fwd"), gpu)
        except Exception as e:  # noqa: BLE001
            failed(name, dtype, dims, e)

    p.line("")
    p.line("| paged case | dtype | B,N,K,H,L,M | lengths | out | ok | s |" + (" cuda |" if p.dry else ""))
    p.line("|---|---|---|---|---:|---|---:|" + ("---|" if p.dry else ""))

    def paged(name, dtype, dims, lengths, kw, mode, gpu=None):
        B, N, K, H, L, M = dims
        P = B * M + 3
        rng = np.random.default_rng(0)
        tables = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
        q = normal(5, (B, N, H), dtype)
        kp, vp = normal(6, (K, P, L, H), dtype), normal(7, (K, P, L, H), dtype)
        n = jnp.asarray(lengths, jnp.int32)
        rkw = {k_: v_ for k_, v_ in kw.items() if k_ in ("alibi_slopes", "softcap", "window")}
        kernel = jax.jit(lambda *a: paged_attention(*a, backend="gpu", interpret=interp, **kw))
        oracle = jax.jit(lambda q, kp, vp, t_, n_: paged_attention_reference(q, kp, vp, t_, n_, **rkw))
        f32 = to_f32(q, kp, vp)
        cuda = ""
        if gpu is not None:
            gB, gN, gK, gH, gL, gM = gpu[0]
            gP = gB * gM + 3
            cuda = cuda_cell(name, lambda *a: paged_attention(*a, backend="gpu", **gpu[2]), *(
                jax.ShapeDtypeStruct(shape, dt) for shape, dt in (
                    ((gB, gN, gH), dtype), ((gK, gP, gL, gH), dtype), ((gK, gP, gL, gH), dtype), ((gB, gM), jnp.int32),
                    ((gB,), jnp.int32))))
        t = time.perf_counter()
        if mode == "trace":
            jax.eval_shape(kernel, q, kp, vp, tables, n)
            jax.eval_shape(oracle, *f32, tables, n)
            p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | {lengths} | traced | | "
                   f"{time.perf_counter() - t:.1f} |{cuda}")
            return
        got = jax.block_until_ready(kernel(q, kp, vp, tables, n))
        with jax.default_matmul_precision("highest"):  # the oracle's einsums carry no precision: no TF32 on a GPU
            want = oracle(*f32, tables, n)
        secs = time.perf_counter() - t
        err = rel_err(got, want)
        ok = err <= TOL_PAGED[jnp.dtype(dtype).name]
        if not ok:
            p.fails.append(f"{name} ({jnp.dtype(dtype).name}): error {err:.2e}")
        p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | {lengths} | {err:.1e} | "
               f"{'ok' if ok else '**FAIL**'} | {secs:.1f} |{cuda}")

    on_gpu = _paged_cases(False)
    for i, (name, dtype, dims, lengths, kw) in enumerate(_paged_cases(p.dry)):
        if not p.room(name):
            continue
        try:
            gpu = (on_gpu[i][2], on_gpu[i][3], on_gpu[i][4]) if p.dry else None
            p.case(paged, name, dtype, dims, lengths, kw, _dry_mode(p.tracing, i), gpu)
        except Exception as e:  # noqa: BLE001
            p.fails.append(f"{name}: {p.error(name, e)}")
            p.line(f"| {name} | {jnp.dtype(dtype).name} | {','.join(map(str, dims))} | {lengths} | error | **FAIL** "
                   "| |" + (" |" if p.dry else ""))
    n_cases = len(_flash_cases(p.dry)) + len(_sparse_cases(p.dry)) + len(_paged_cases(p.dry))
    summary = f"{p.ran - len(p.fails)}/{n_cases} cases passed" + (" (dry run: most only traced)" if p.tracing else "")
    p.line(f"\n(a): {summary}" + (f", {len(p.not_run)} not run" if p.not_run else ""))
    p.finish(summary=summary)



