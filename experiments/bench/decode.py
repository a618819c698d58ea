"""Decode benchmark: paged vs contiguous KV memory, cache vs recompute, engine vs one by one.

CPU part (always):

(a) Memory. Sequence lengths ~ lognormal(median 300, sigma 1.0) clipped to
    [16, 2048]. A fixed KV budget of 32,768 token slots (16 GiB of fp16 K/V for a
    LLaMA-7B: 512 KiB per token). Contiguous preallocation gives every sequence
    2048 slots; the paged cache (L=16) adds sequences through the real
    ``BlockManager`` until it runs out of pages. Utilisation = slots holding real
    tokens / slots allocated.
(b) Cache vs recompute. One sequence, a 1024-token context: decode tokens/s of
    ``generate``'s jitted decode step against recomputing the full causal
    forward over the (fixed-width, right-padded) context for every new token.
(c) Engine vs one by one. 32 requests (prompts 16..128 tokens, 32 new tokens,
    greedy): the continuous-batching engine (32 slots) against ``generate`` on
    each request alone (and against the engine with 1 slot). Compilation is
    excluded (a warm-up pass over the same shapes first).

GPU part (only when ``jax.default_backend() == "gpu"``): the paged-attention
kernel at batch 64, contexts 2k/4k/8k, 32 query heads on 8 kv heads (GQA 4:1),
H=128, L=16, bf16, with shuffled pages: achieved bandwidth (K/V bytes read /
time) against a device-to-device copy measured in the same run; and the kernel
against our contiguous-cache decode (``dot_product_attention`` on ``[B,S,K,H]``
with the cache's mask).

    python experiments/bench/decode.py                  # print tables
    python experiments/bench/decode.py --write          # also experiments/results/decode_{cpu,gpu}.md

Like every benchmark it runs as a script with ``jaxformer`` installed (``pip install -e .``);
timings come from the shared :mod:`timing` helpers beside it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds, timed

from jaxformer.decode.block_manager import BlockManager, OutOfPages
from jaxformer.decode.engine import Engine
from jaxformer.decode.generate import decode_step, generate, prefill_step
from jaxformer.decode.kv_cache import init_caches
from jaxformer.decode.sampling import SamplingParams
from jaxformer.model import ModelConfig, apply, init

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- (a) memory


def bench_memory(seed: int = 0, budget_slots: int = 32768, max_len: int = 2048, page: int = 16):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(300), 1.0, size=100_000)), 16, max_len).astype(int)
    n_contig = budget_slots // max_len
    util_contig = lengths[:n_contig].sum() / (n_contig * max_len)
    mgr = BlockManager(budget_slots // page, page, prefix_sharing=False)
    n_paged = 0
    for i, n in enumerate(lengths):
        try:
            mgr.add(i, [0] * int(n))
        except OutOfPages:
            break
        n_paged += 1
    used_pages = mgr.num_pages - mgr.num_free
    util_paged = lengths[:n_paged].sum() / (used_pages * page)
    rows = [
        ("contiguous (2048 each)", n_contig, f"{util_contig:.1%}", f"{1 - util_contig:.1%}"),
        (f"paged (L={page})", n_paged, f"{util_paged:.1%}", f"{1 - util_paged:.1%}"),
    ]
    summary = dict(waste_paged=1 - util_paged, seq_ratio=n_paged / n_contig,
                   median_len=float(np.median(lengths)), mean_len=float(lengths.mean()),
                   util_contig=float(util_contig), util_paged=float(util_paged), n_contig=int(n_contig),
                   n_paged=int(n_paged), lengths=lengths)
    return rows, summary


# --------------------------------------------------------------------------- (b) cache vs recompute


def bench_cache_vs_recompute(context: int = 1024, new: int = 16):
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, activation="swiglu",
                      norm="rmsnorm", position="rope", max_seq_len=context + new + 16)
    graphdef, state = init(cfg, jax.random.key(0))
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(1, context)), jnp.int32)
    samp = dict(seeds=jnp.zeros(1, jnp.uint32), temperature=jnp.zeros(1), top_k=jnp.zeros(1, jnp.int32),
                top_p=jnp.ones(1))

    def decode(tok, caches):
        for i in range(new):
            tok, caches = decode_step(graphdef, state, caches, tok, jnp.full((1,), i + 1), **samp)
        return tok

    def cached():
        caches = init_caches(cfg, 1, context + new)
        tok, caches = prefill_step(graphdef, state, caches, prompt, jnp.asarray([context]), **samp)
        return timed(decode, jax.block_until_ready(tok), caches)[1]

    width = context + new
    full = jax.jit(lambda s, t, i: jnp.argmax(apply(graphdef, s, t)[0, i]))

    def extend(seq):
        for i in range(new):
            nxt = full(state, seq, context - 1 + i)
            seq = seq.at[0, context + i].set(nxt)
        return seq

    def recompute():
        return timed(extend, jnp.zeros((1, width), jnp.int32).at[:, :context].set(prompt))[1]

    cached(), recompute()  # compile
    t_cache, t_full = [], []
    for _ in range(3):  # alternate, so a busy machine slows both alike
        t_cache.append(cached())
        t_full.append(recompute())
    t_cache, t_full = statistics.median(t_cache), statistics.median(t_full)
    rows = [("KV cache", f"{new / t_cache:,.1f}", f"{1e3 * t_cache / new:.2f}"),
            ("full recompute", f"{new / t_full:,.1f}", f"{1e3 * t_full / new:.2f}")]
    return rows, dict(speedup=t_full / t_cache, config=cfg, cache_tokens_per_s=new / t_cache,
                      recompute_tokens_per_s=new / t_full)


# --------------------------------------------------------------------------- (c) engine vs one by one


def bench_engine(n_requests: int = 32, new: int = 32, slots: int = 32):
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, activation="swiglu",
                      norm="rmsnorm", position="rope", max_seq_len=256)
    graphdef, state = init(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, size=int(n)))) for n in rng.integers(16, 129, size=n_requests)]
    params = SamplingParams(max_new_tokens=new)
    page = 16
    num_pages = slots * -(-(128 + new) // page)

    def engine(max_batch):
        e = Engine(graphdef, state, cfg, num_pages=num_pages, page_size=page, max_batch=max_batch, chunk_size=64)
        ids = [e.submit(p, params) for p in prompts]
        res = e.run()
        return [res[i].tokens for i in ids]

    def alone():
        return [generate(graphdef, state, cfg, [p], max_new_tokens=new)[0] for p in prompts]

    out_engine, out_alone, _ = engine(slots), alone(), engine(1)  # compile every shape
    assert out_engine == out_alone, "engine and one-by-one outputs differ"
    t_engine, t_alone = [], []
    for _ in range(3):  # alternate, so a busy machine slows both alike
        t_engine.append(timed(engine, slots)[1])
        t_alone.append(timed(alone)[1])
    t_engine, t_alone = statistics.median(t_engine), statistics.median(t_alone)
    t_engine1 = timed(engine, 1)[1]
    tokens = n_requests * new
    rows = [(f"engine, {slots} slots", f"{tokens / t_engine:,.0f}", f"{t_engine:.2f}"),
            ("generate() one by one", f"{tokens / t_alone:,.0f}", f"{t_alone:.2f}"),
            ("engine, 1 slot", f"{tokens / t_engine1:,.0f}", f"{t_engine1:.2f}")]
    return rows, dict(speedup=t_alone / t_engine, speedup_vs_engine1=t_engine1 / t_engine)


# --------------------------------------------------------------------------- GPU


def bench_gpu():
    from jaxformer.ops.attention import dot_product_attention
    from jaxformer.ops.masks import MaskSpec
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

    B, N, K, H, L = 64, 32, 8, 128, 16
    rows = []
    rng = np.random.default_rng(0)
    for ctx in (2048, 4096, 8192):
        M = ctx // L
        P = B * M
        key = jax.random.key(ctx)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (B, N, H), jnp.bfloat16)
        k_pages = jax.random.normal(kk, (K, P, L, H), jnp.bfloat16)
        v_pages = jax.random.normal(kv, (K, P, L, H), jnp.bfloat16)
        tables = jnp.asarray(rng.permutation(P).reshape(B, M), jnp.int32)
        lengths = jnp.full((B,), ctx, jnp.int32)
        kernel = jax.jit(lambda q, kp, vp, t, n: paged_attention(q, kp, vp, t, n, backend="gpu"))
        got = kernel(q, k_pages, v_pages, tables, lengths)
        want = paged_attention_reference(q, k_pages, v_pages, tables, lengths)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        if err > 3e-2:
            raise SystemExit(f"paged kernel mismatch on the GPU at ctx {ctx}: max abs error {err}")
        nbytes = 2 * k_pages.size * k_pages.dtype.itemsize
        t_kernel = median_seconds(kernel, q, k_pages, v_pages, tables, lengths, repeats=20)
        copy = jax.jit(lambda a, b: (a + 0, b + 0))
        t_copy = median_seconds(copy, k_pages, v_pages, repeats=20)
        bw_kernel, bw_copy = nbytes / t_kernel, 2 * nbytes / t_copy  # a copy reads and writes
        kc = jnp.asarray(rng.normal(size=(B, ctx, K, H)), jnp.bfloat16)
        vc = jnp.asarray(rng.normal(size=(B, ctx, K, H)), jnp.bfloat16)
        contiguous = jax.jit(lambda q, k, v, n: dot_product_attention(
            q[:, None], k, v, mask=MaskSpec(causal=True, q_offset=n - 1, kv_lengths=n)))
        t_contig = median_seconds(contiguous, q, kc, vc, lengths, repeats=20)
        rows.append((ctx, f"{1e6 * t_kernel:.0f}", f"{bw_kernel / 1e9:,.0f}", f"{bw_copy / 1e9:,.0f}",
                     f"{bw_kernel / bw_copy:.0%}", f"{1e6 * t_contig:.0f}", f"{t_contig / t_kernel:.2f}x"))
    return rows


# --------------------------------------------------------------------------- main


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write experiments/results/decode_{cpu,gpu}.md")
    args = ap.parse_args(argv)
    command = "python experiments/bench/decode.py" + (" --write" if args.write else "")
    out = [f"# Decode benchmark ({jax.default_backend()}, jax {jax.__version__})", "", f"Command: `{command}`", "",
           f"Machine: {os.cpu_count()} CPU cores shared with other jobs (load average {os.getloadavg()[0]:.1f} "
           "at start); every ratio is measured side by side in one run, timings alternate.", ""]

    rows, s = bench_memory()
    out += ["## (a) KV memory: paged vs contiguous", "",
            f"Budget 32,768 token slots; lengths lognormal median 300 sigma 1.0 clipped [16, 2048] "
            f"(sample median {s['median_len']:.0f}, mean {s['mean_len']:.0f}).", "",
            table(["cache", "sequences that fit", "utilisation", "waste"], rows), "",
            f"Paged waste {s['waste_paged']:.1%} (goal < 4%): {'met' if s['waste_paged'] < 0.04 else 'MISSED'}; "
            f"{s['seq_ratio']:.1f}x the sequences (goal >= 2.5x): {'met' if s['seq_ratio'] >= 2.5 else 'MISSED'}.",
            ""]
    print("\n".join(out[-9:]), flush=True)

    rows, s = bench_cache_vs_recompute()
    c = s["config"]
    out += ["## (b) Decode with the KV cache vs full recompute, context 1024", "",
            f"Model: d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads, "
            f"batch 1, fp32; 16 tokens after a 1024-token prompt, median of 3 runs.", "",
            table(["decode", "tokens/s", "ms/token"], rows), "",
            f"Speed-up {s['speedup']:.1f}x (goal >= 20x): {'met' if s['speedup'] >= 20 else 'MISSED'}.", ""]
    print("\n".join(out[-7:]), flush=True)

    rows, s = bench_engine()
    out += ["## (c) Engine vs one by one, 32 requests", "",
            "Model: d_model 128, 2 layers, GQA 4:2; prompts 16..128 tokens, 32 greedy new tokens each "
            "(outputs checked equal); compile excluded.", "",
            table(["serving", "tokens/s", "seconds"], rows), "",
            f"Speed-up vs generate() one by one {s['speedup']:.1f}x (goal >= 3x): "
            f"{'met' if s['speedup'] >= 3 else 'MISSED'}; vs the engine with one slot "
            f"{s['speedup_vs_engine1']:.1f}x.", ""]
    print("\n".join(out[-7:]), flush=True)

    if args.write:
        path = os.path.join(ROOT, "experiments", "results", "decode_cpu.md")
        with open(path, "w") as f:
            f.write("\n".join(out))
        print(f"wrote {path}")

    if jax.default_backend() == "gpu":
        rows = bench_gpu()
        gpu = [f"# Paged-attention kernel on {jax.devices()[0].device_kind}", "", f"Command: `{command}`", "",
               "Batch 64, 32 query heads / 8 kv heads, H=128, L=16, bf16, shuffled pages, every sequence full.",
               "Bandwidth = K/V bytes read / time; copy = (read + write) / time of a device-to-device copy of "
               "the same pools; contiguous = our dot_product_attention decode over [B, S, K, H].", "",
               table(["context", "kernel us", "kernel GB/s", "copy GB/s", "of copy (goal >= 80%)",
                      "contiguous us", "paged speed vs contiguous (goal >= 0.9x)"], rows), ""]
        print("\n".join(gpu), flush=True)
        if args.write:
            with open(os.path.join(ROOT, "experiments", "results", "decode_gpu.md"), "w") as f:
                f.write("\n".join(gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
