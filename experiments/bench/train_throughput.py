"""Tokens/s of the library's jitted train step vs a minimal hand-written JAX step, side by side.

The hand-written step is a plain-``jnp`` GPT (no Flax, no jaxformer modules):
pre-LayerNorm blocks, learned positions, GELU(tanh) MLP, tied embeddings,
biases, causal + packed-segment attention mask, fp32 cross entropy. It reads
the library's parameter tree (same names and shapes: GPT-2 preset layout) and
uses the same optax chain (global-norm clipping + AdamW with the same decay
mask), so both steps do the same math on the same batch; the script checks
that their first losses agree before timing. Steps are timed in alternating
rounds; the table shows the median per-step time of each, the ratio, and an MFU
estimate: model FLOPs (``jaxformer.model.flops_per_token``) per second over
the peak (an fp32 matmul measured in the same run on CPU; the GPU's datasheet
dense bf16/fp32 peak when given with ``--peak-tflops``).

    python experiments/bench/train_throughput.py                 # CPU-sized default
    python experiments/bench/train_throughput.py --d-model 768 --layers 12 --seq-len 1024 --batch 16 \
        --dtype bfloat16 --peak-tflops 989                        # an H100/H200-sized run
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from timing import timed, wall_times

from jaxformer.model import flops_per_token
from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.corpus import build_corpus
from jaxformer.train.optim import decay_mask
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.step import make_trainer


def experiment(args) -> C.ExperimentConfig:
    return C.from_dict({
        "seed": 0, "steps": 1000, "batch_size": args.batch, "seq_len": args.seq_len,
        "model": {"preset": "gpt2_small", "vocab_size": 264, "d_model": args.d_model, "n_layers": args.layers,
                  "n_heads": args.d_model // 64 if args.d_model >= 128 else 2, "max_seq_len": args.seq_len,
                  "compute_dtype": args.dtype, "attention_impl": args.attention},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "clip_norm": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 10},
        "mesh": {"data": 1},
    }, "<bench>")


# -- the hand-written GPT ---------------------------------------------------------------------

def _ln(x, p, eps):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mu).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x.dtype)


def hand_loss(params, batch, *, eps: float, dtype):
    """Plain-jnp GPT forward + masked mean cross entropy, on the library's parameter tree."""
    cast = lambda a: a.astype(dtype)  # noqa: E731
    tok, pos, seg = batch["inputs"], batch["positions"], batch["segment_ids"]
    T = tok.shape[1]
    wte = params["embed"]["embedding"]
    x = cast(wte[tok] + params["pos_embed"]["embedding"][pos])
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
    blocks = params["decoder"]["blocks"]
    for i in range(len(blocks)):
        b = blocks[i]
        a = b["self_attn"]
        h = _ln(x, b["attn_residual"]["norm"], eps)
        q = jnp.einsum("BTD,DNH->BTNH", h, cast(a["w_q"])) + cast(a["b_q"])
        k = jnp.einsum("BTD,DNH->BTNH", h, cast(a["w_k"])) + cast(a["b_k"])
        v = jnp.einsum("BTD,DNH->BTNH", h, cast(a["w_v"])) + cast(a["b_v"])
        s = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
        s = jnp.where(mask[:, None], s, -1e30)
        w = jax.nn.softmax(s, axis=-1).astype(dtype)
        o = jnp.einsum("BNTS,BSNH->BTNH", w, v)
        x = x + jnp.einsum("BTNH,NHD->BTD", o, cast(a["w_o"])) + cast(a["b_o"])
        m = b["mlp"]
        h = _ln(x, b["mlp_residual"]["norm"], eps)
        h = jax.nn.gelu(h @ cast(m["w_in"]) + cast(m["b_in"]), approximate=True)
        x = x + h @ cast(m["w_out"]) + cast(m["b_out"])
    x = _ln(x, params["decoder"]["final_norm"], eps)
    logits = jnp.einsum("BTD,VD->BTV", x, cast(wte), preferred_element_type=jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    mk = batch["mask"]
    return jnp.sum(jnp.where(mk, logz - tgt, 0.0)) / jnp.maximum(mk.sum(), 1)


def hand_step_fn(cfg: C.ExperimentConfig, params_like):
    opt = optax.chain(
        optax.clip_by_global_norm(cfg.optimizer.clip_norm),
        optax.adamw(optax.join_schedules([optax.linear_schedule(0.0, cfg.optimizer.lr, cfg.schedule.warmup_steps),
                                          optax.cosine_decay_schedule(cfg.optimizer.lr,
                                                                      cfg.steps - cfg.schedule.warmup_steps,
                                                                      alpha=cfg.schedule.min_lr_ratio)],
                                         [cfg.schedule.warmup_steps]),
                    b1=cfg.optimizer.b1, b2=cfg.optimizer.b2, eps=cfg.optimizer.eps,
                    weight_decay=cfg.optimizer.weight_decay, mask=decay_mask(params_like, cfg.optimizer)),
    )
    dtype = jnp.dtype(cfg.model.compute_dtype)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(hand_loss)(params, batch, eps=cfg.model.norm_eps, dtype=dtype)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, jax.jit(step, donate_argnums=(0, 1))


# -- timing -----------------------------------------------------------------------------------

def measured_peak_flops() -> float:
    """FLOP/s of a large fp32 matmul on the default device (the CPU 'peak' for MFU)."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    return 2 * n**3 / min(wall_times(jax.jit(lambda x: x @ x), a, repeats=5))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="xla", choices=["auto", "xla", "blockwise", "pallas"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: measured fp32 matmul)")
    args = p.parse_args(argv)

    cfg = experiment(args)
    mesh = S.make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    state = trainer.init_state()
    corpus = build_corpus(C.DataConfig())
    it = TrainIterator(corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=0)
    batches = [S.put_batch(next(it), mesh) for _ in range(args.steps)]

    hand_params = jax.tree.map(jnp.copy, state["params"])
    opt, hand_step = hand_step_fn(cfg, hand_params)
    hand_opt = opt.init(hand_params)

    state, m = trainer.train_step(state, batches[0])
    hand_params, hand_opt, hand_l = hand_step(hand_params, hand_opt, batches[0])
    lib_l = float(m["loss"])
    tol = 1e-4 if args.dtype == "float32" else 2e-2
    agree = abs(lib_l - float(hand_l)) <= tol * abs(lib_l)
    print(f"first-step loss: library {lib_l:.6f}  hand-written {float(hand_l):.6f}  "
          f"({'agree' if agree else 'DISAGREE'} within {tol:g} relative)")

    for b in batches[:2]:  # settle shardings / compile caches of both steps
        state, m = trainer.train_step(state, b)
        hand_params, hand_opt, hand_l = hand_step(hand_params, hand_opt, b)
    jax.block_until_ready((m, hand_l))

    def library_round(state):
        for b in batches:
            state, _ = trainer.train_step(state, b)
        return state

    def hand_round(params, opt_state):
        for b in batches:
            params, opt_state, _ = hand_step(params, opt_state, b)
        return params, opt_state

    lib_t, hand_t = [], []
    for _ in range(args.rounds):  # alternate, so a busy machine slows both alike
        state, seconds = timed(library_round, state)
        lib_t.append(seconds / len(batches))
        (hand_params, hand_opt), seconds = timed(hand_round, hand_params, hand_opt)
        hand_t.append(seconds / len(batches))

    tokens = cfg.batch_size * cfg.seq_len
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else measured_peak_flops()
    peak_src = "given" if args.peak_tflops else "measured fp32 matmul"
    print(f"device {jax.devices()[0].device_kind}; model d={args.d_model} L={args.layers} T={cfg.seq_len} "
          f"B={cfg.batch_size} {args.dtype}; {fpt / 1e6:.1f} MFLOP/token; peak {peak / 1e12:.2f} TFLOP/s ({peak_src})")
    print(f"{'step':<14}{'ms/step':>10}{'tokens/s':>14}{'MFU':>8}")
    rows = {}
    for name, ts in (("library", lib_t), ("hand-written", hand_t)):
        s = statistics.median(ts)
        rows[name] = tokens / s
        print(f"{name:<14}{s * 1e3:>10.1f}{tokens / s:>14,.0f}{fpt * tokens / s / peak:>8.1%}")
    print(f"ratio library / hand-written tokens/s: {rows['library'] / rows['hand-written']:.3f} (goal >= 0.95)")
    return rows


if __name__ == "__main__":
    main()
