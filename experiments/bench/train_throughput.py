"""Tokens/s of the library's jitted train step vs a hand-written JAX step and (``--vs-torch``) PyTorch, side by side.

The hand-written step is a plain-``jnp`` GPT (no Flax, no jaxformer modules):
pre-LayerNorm blocks, learned positions, GELU(tanh) MLP, tied embeddings,
biases, causal + packed-segment attention mask, fp32 cross entropy. It reads
the library's parameter tree (same names and shapes: GPT-2 preset layout) and
uses the same optax chain (global-norm clipping + AdamW with the same decay
mask), so both steps do the same math on the same batch.

``--vs-torch`` (only where ``torch`` is importable; it is never a dependency of the library) adds the
PyTorch twin: the same GPT written as a PyTorch user would (nanoGPT's layout: fused QKV ``Linear``,
``scaled_dot_product_attention`` with the same causal + segment mask, ``nn.LayerNorm``, tanh GELU,
tied head), initialised from the library's parameters (both parameter counts are printed), trained in
eager mode with ``torch.optim.AdamW`` (same betas, eps, weight decay on the matrices only), clipping and
the same warmup + cosine schedule. ``--before`` adds the library's step as it was before issue 16
(attention differentiated by plain autodiff through ``xla_attention``), ``--no-chunks`` the step
without causal attention chunks and ``--einsum`` the step with its projections as einsums over the
``[B, T, ...]`` activations (before issue 23) and ``--rope-fused`` the step with RoPE's cos / sin tables left to
XLA's fusion (before ``aac4be8``: recomputed for every rotated element on the CPU; RoPE models only, e.g.
``--config experiments/configs/stdlib_bpe.yaml``), each compiled in the same process. Where the library's step
computes each batch in more than one part side by side (``optimizer.parallel_parts``: "auto", 4 or 2 on the CPU
by the micro-batch's work and the model's size, or ``--parts N``), the one-part step is timed beside it ("library
one part"); ``--also-parts N ...`` times other part counts beside them ("library N parts").

Run as a script it first starts itself again with glibc's malloc asking for huge pages, as ``jaxformer train``
does (``jaxformer.train.host_memory``; ``JAXFORMER_HUGE_PAGES=0``: glibc's defaults; the CPU line says
which), so every contender in the process runs under it; the A/B of the two is two processes.

The script checks that every contender's first loss agrees with the library's, then times them in
alternating rounds (``--steps`` timed steps per round, each contender's after one untimed step of its own) so a
busy machine slows each alike; the table shows
the median wall ms/step, tokens/s, MFU and the process CPU time per step of each, and the ratios. MFU =
``jaxformer.model.flops_per_token`` x tokens/s over the peak of ``jaxformer.train.metrics.device_peak``
(on CPU an fp32 matmul measured in the same run; GPUs/TPUs their datasheet dense bf16 peak, or
``--peak-tflops``).

    python experiments/bench/train_throughput.py --vs-torch --before      # nanoGPT-sized default, CPU
    taskset -c 1 python experiments/bench/train_throughput.py --vs-torch  # one core: both steps single-threaded
    python experiments/bench/train_throughput.py --d-model 768 --layers 12 --seq-len 1024 --batch 16 \
        --dtype bfloat16 --attention auto                                   # an H100/H200-sized run
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxformer.model import count_params, flops_per_token
from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.corpus import build_corpus
from jaxformer.train.metrics import device_peak
from jaxformer.train.optim import decay_mask, make_schedule
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.step import make_trainer
from timing import alternating_rounds, cpu_line  # cpu_line: the CPU model, its ISA flags, the cores and the load
from jaxformer.train.host_memory import restart_with_huge_pages


def experiment(args) -> C.ExperimentConfig:
    return C.from_dict({
        "seed": 0, "steps": 1000, "batch_size": args.batch, "seq_len": args.seq_len,
        "model": {"preset": "gpt2_small", "vocab_size": 264, "d_model": args.d_model, "n_layers": args.layers,
                  "n_heads": args.heads or (args.d_model // 64 if args.d_model >= 128 else 2),
                  "max_seq_len": args.seq_len, "compute_dtype": args.dtype, "attention_impl": args.attention},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "clip_norm": 1.0,
                      "parallel_parts": "auto" if args.parts is None else args.parts},
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
    tok, pos, seg = batch.tokens, batch.positions, batch.segment_ids
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
    tgt = jnp.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0]
    mk = batch.loss_mask
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
        loss, grads = jax.value_and_grad(hand_loss)(params, batch, eps=cfg.model.norm.eps, dtype=dtype)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, jax.jit(step, donate_argnums=(0, 1))


# -- the PyTorch twin (optional anchor: torch is never a dependency of the library) --------------

def torch_twin(cfg: C.ExperimentConfig, params, batches):
    """``(step, n_params, torch)``: the same GPT written the way a PyTorch user would (nanoGPT:
    fused QKV ``Linear``, ``F.scaled_dot_product_attention``, ``nn.LayerNorm``, ``GELU(tanh)``, tied head),
    initialised from the library's parameters, trained with ``torch.optim.AdamW`` (same betas, eps, weight
    decay and decay mask: matrices only), ``clip_grad_norm_`` and the same warmup + cosine schedule, on the
    same packed batches (causal + segment mask, masked mean cross entropy). ``step(i)`` runs one
    optimiser step on ``batches[i % len(batches)]`` and returns the loss tensor. None when torch is absent."""
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn
    except ImportError:
        return None
    if cfg.model.compute_dtype != "float32":
        raise SystemExit("--vs-torch compares fp32 steps only")
    m = cfg.model
    D, N, L, V = m.d_model, m.attention.n_heads, m.n_layers, m.vocab_size
    H = D // N
    eps = m.norm.eps
    t = lambda a: torch.from_numpy(np.array(a, np.float32))  # noqa: E731

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(D, eps=eps), nn.LayerNorm(D, eps=eps)
            self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x, mask):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
            q, k, v = (z.view(B, T, N, H).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, D))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(m.max_seq_len, D)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(D, eps=eps)

        def forward(self, tok, pos, seg):
            mask = torch.tril(torch.ones(tok.shape[1], tok.shape[1], dtype=torch.bool))
            mask = (mask[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]  # [B, 1, T, T]
            x = self.wte(tok) + self.wpe(pos)
            for b in self.h:
                x = b(x, mask)
            return self.ln_f(x) @ self.wte.weight.T  # tied head

    model = GPT()
    with torch.no_grad():  # the library's initial parameters, in nanoGPT's layout
        model.wte.weight.copy_(t(params["embed"]["embedding"]))
        model.wpe.weight.copy_(t(params["pos_embed"]["embedding"]))
        blocks = params["decoder"]["blocks"]
        for i, b in enumerate(model.h):
            a, mp = blocks[i]["self_attn"], blocks[i]["mlp"]
            b.c_attn.weight.copy_(torch.cat([t(a[w]).reshape(D, D) for w in ("w_q", "w_k", "w_v")], 1).T)
            b.c_attn.bias.copy_(torch.cat([t(a[w]).reshape(D) for w in ("b_q", "b_k", "b_v")]))
            b.c_proj.weight.copy_(t(a["w_o"]).reshape(D, D).T)
            b.c_proj.bias.copy_(t(a["b_o"]))
            b.c_fc.weight.copy_(t(mp["w_in"]).T)
            b.c_fc.bias.copy_(t(mp["b_in"]))
            b.mlp_proj.weight.copy_(t(mp["w_out"]).T)
            b.mlp_proj.bias.copy_(t(mp["b_out"]))
            for ln, name in ((b.ln_1, "attn_residual"), (b.ln_2, "mlp_residual")):
                ln.weight.copy_(t(blocks[i][name]["norm"]["scale"]))
                ln.bias.copy_(t(blocks[i][name]["norm"]["bias"]))
        model.ln_f.weight.copy_(t(params["decoder"]["final_norm"]["scale"]))
        model.ln_f.bias.copy_(t(params["decoder"]["final_norm"]["bias"]))
    n_params = sum(p.numel() for p in model.parameters())
    o = cfg.optimizer
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
    schedule = make_schedule(o, cfg.schedule, cfg.schedule.decay_steps or cfg.steps)
    tb = []
    for b in batches:
        tgt = np.where(b.loss_mask, b.targets, -100)
        tb.append(tuple(torch.from_numpy(np.asarray(x, np.int64)) for x in
                        (b.tokens, b.positions, b.segment_ids, tgt)))
    state = {"i": 0}

    def step(_=None):
        i = state["i"]
        tok, pos, seg, tgt = tb[i % len(tb)]
        for g in opt.param_groups:
            g["lr"] = float(schedule(i))
        logits = model(tok, pos, seg)
        loss = F.cross_entropy(logits.view(-1, V), tgt.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        state["i"] = i + 1
        return loss

    return step, n_params, torch


# -- timing -----------------------------------------------------------------------------------

def variant_step(name: str, cfg: C.ExperimentConfig, mesh, state, batch, frozen=None):
    """The library's train step compiled with part of issue 16's attention change undone, in this process:
    ``"before"``: attention differentiated by plain autodiff through ``xla_attention`` (the library before
    issue 16); ``"no chunks"``: the hand-written derivative over every key (no causal chunks); ``"einsum"``:
    every projection an einsum over the ``[B, T, ...]`` activations (the library before issue 23's 2-D
    products, ``jaxformer.nn.params.project``); ``"rope fused"``: RoPE's cos / sin tables fused into the rotation
    (``jaxformer.ops.positional._unfusable_copy`` skipped: the library before ``aac4be8``)."""
    import contextlib
    from unittest import mock

    import jaxformer.nn.attention as NA
    import jaxformer.nn.embedding as NE
    import jaxformer.nn.lora as NL
    import jaxformer.nn.mlp as NM
    import jaxformer.ops.attention as A
    import jaxformer.ops.positional as P
    from jaxformer.train import step as step_mod

    def autodiff(q, k, v, *, mask=None, scale=None):
        return A.xla_attention(q, k, v, mask=mask, scale=scale)

    def tensordot_project(x, w, dtype, *, n_in=1, preferred_element_type=None):  # LoRA's adapters, the heads, the FFNs
        return jnp.tensordot(x.astype(dtype), w.astype(dtype), n_in, preferred_element_type=preferred_element_type)

    def einsum_project(x, w, dtype, *, n_in=1, preferred_element_type=None):
        if n_in == 2:  # the attention's output projection was already [B, T, N*H] @ [N*H, D]
            return jnp.matmul(x.astype(dtype).reshape(*x.shape[:-2], -1), w.astype(dtype).reshape(-1, w.shape[-1]))
        return tensordot_project(x, w, dtype, preferred_element_type=preferred_element_type)

    patch = contextlib.ExitStack()
    if name == "before":
        patch.enter_context(mock.patch.object(A, "dense_attention", autodiff))
    elif name == "no chunks":
        patch.enter_context(mock.patch.object(A, "_CHUNK", 1 << 30))
    elif name == "rope fused":
        patch.enter_context(mock.patch.object(P, "_unfusable_copy", lambda t: t))
    else:
        for module in (NA, NE, NM):
            patch.enter_context(mock.patch.object(module, "project", einsum_project))
        patch.enter_context(mock.patch.object(NL, "project", tensordot_project))
    # make_trainer caches one Trainer (one jitted step, one trace) per config: a cached one would be lowered from
    # the trace it already has, without the patch. Emptied before, so the step is built and traced under the
    # patch, and after, so nothing later is handed the patched trainer.
    step_mod._make_trainer.cache_clear()
    step_mod._make_lora_trainer.cache_clear()
    try:
        with patch:
            compiled = make_trainer(cfg, mesh).train_step.lower(state, batch).compile()
    finally:
        step_mod._make_trainer.cache_clear()
        step_mod._make_lora_trainer.cache_clear()
    if frozen is None:
        return compiled
    return _Frozen(compiled, frozen)


class _Frozen:
    """A compiled LoRA step ``(frozen, state, batch)`` called as ``(state, batch)`` with the base given once."""

    def __init__(self, compiled, frozen):
        self.compiled, self.frozen = compiled, frozen

    def __call__(self, state, batch):
        return self.compiled(self.frozen, state, batch)

    def as_text(self):
        return self.compiled.as_text()


def scan_remat_step(cfg: C.ExperimentConfig, mesh, state, batch):
    """``[compiled step, state]`` of the same model with ``model.scan_layers`` and ``model.remat`` on (one
    block compiled once and scanned over the layers; its activations recomputed in the backward instead
    of stored), starting from the library's parameters, stacked along the layer axis."""
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"scan_layers": True, "remat": True})})
    trainer = make_trainer(other, mesh)
    params = jax.tree.map(jnp.copy, state["params"])
    blocks = params["decoder"]["blocks"]
    params["decoder"]["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(len(blocks))])
    st = trainer.init_state_from(params)
    return [trainer.train_step.lower(st, batch).compile(), st]


def timed_rounds(rounds: dict, batches: list, n: int) -> tuple[dict, dict]:
    """``n`` alternating rounds (:func:`timing.alternating_rounds`) of each contender ``rounds[name](bs)``: one
    untimed step, then ``len(batches)`` timed steps. Wall and CPU seconds per step, a list of one per round, by
    contender.

    The untimed step is meant to time each contender's steady state rather than its first step after another
    contender's (a train run has no other contender). Twin shape, two processes each way: per-round library /
    one-part ratios 0.93-1.32 without it, 1.00-1.11 with it; why the old order moved them is not settled
    (experiments/results/train_throughput.md, fourteenth stop)."""
    wall, cpu, _ = alternating_rounds({k: (functools.partial(fn, batches[:1]), [(k, functools.partial(fn, batches))])
                                       for k, fn in rounds.items()}, n)
    return ({k: [t / len(batches) for t in wall[k]] for k in rounds},
            {k: [t / len(batches) for t in cpu[k]] for k in rounds})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, help="default d_model // 64 (2 below d_model 128)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="xla", choices=["auto", "xla", "blockwise", "pallas"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--vs-torch", action="store_true",
                   help="also time the PyTorch twin (eager, AdamW) when torch is importable")
    p.add_argument("--no-hand", action="store_true", help="skip the hand-written JAX step")
    p.add_argument("--before", action="store_true",
                   help="also time the library's step as it was before issue 16 (autodiff attention)")
    p.add_argument("--einsum", action="store_true",
                   help="also time the library's step with every projection an einsum over [B, T, ...] (before issue 23)")
    p.add_argument("--rope-fused", action="store_true",
                   help="also time the library's step with RoPE's cos/sin fused into the rotation (the library "
                        "before aac4be8); RoPE configs only, e.g. --config experiments/configs/stdlib_bpe.yaml")
    p.add_argument("--no-chunks", action="store_true",
                   help="also time the library's step without causal attention chunks")
    p.add_argument("--scan-remat", action="store_true",
                   help="add the library's step with model.scan_layers and model.remat on (same parameters)")
    p.add_argument("--config", help="time this experiment config's step instead (e.g. experiments/configs/"
                   "stdlib_bytes.yaml, the main job); only the library and its --before / --no-chunks / --einsum / "
                   "--rope-fused variants")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: an override, as on jaxformer's command line (e.g. 'model.lora={rank: 16, "
                        "alpha: 32}': a LoRA fine-tune's step, its frozen base read from the config's model source)")
    p.add_argument("--parts", type=int,
                   help="the library's step with optimizer.parallel_parts=N (default the config's, 'auto': 4, 2 or 1 "
                        "on the CPU, jaxformer.train.step.AUTO_PARTS); whenever the library's step runs more than one "
                        "part, the one-part step is also timed, as 'library one part'")
    p.add_argument("--also-parts", type=int, nargs="+", default=[], metavar="N",
                   help="also time the library's step with optimizer.parallel_parts=N for each N (rows 'library N "
                        "parts', each with its ratio to the one-part step, timed too where the library's step runs "
                        "more than one part): the part counts side by side in one run")
    p.add_argument("--peak-tflops", type=float,
                   help="per-device peak for MFU (default: datasheet bf16 on GPU/TPU, measured fp32 matmul on CPU)")
    args = p.parse_args(argv)

    if args.set and not args.config:
        p.error("--set overrides a --config file's keys; give --config")
    if args.config:
        cfg = C.load(args.config, ["mesh.data=1", *args.set,
                                   *([] if args.parts is None else [f"optimizer.parallel_parts={args.parts}"])])
        args.no_hand, args.vs_torch, args.dtype = True, False, cfg.model.compute_dtype
        args.d_model, args.layers = cfg.model.d_model, cfg.model.n_layers
    else:
        cfg = experiment(args)
    mesh = S.make_mesh(cfg.mesh)
    for n in args.also_parts:  # before anything is built
        try:
            if n < 1:
                raise ValueError("a number of parts >= 1")
            S.check_batch(cfg.batch_size, cfg.optimizer.grad_accum, mesh.shape, n)
        except ValueError as e:
            p.error(f"--also-parts {n}: {e}")
    trainer = make_trainer(cfg, mesh)
    if cfg.model.lora is not None:  # a LoRA step: its frozen base read from the model's source
        from jaxformer.train.lora import attach_base
        attach_base(cfg, trainer)
    state = trainer.init_state()
    corpus = build_corpus(C.DataConfig())  # byte tokens: valid ids of any vocabulary of >= 264
    it = TrainIterator(corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=0)
    host_batches = [next(it) for _ in range(args.steps)]
    batches = [S.put_batch(b, mesh) for b in host_batches]
    n_lib = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    print(f"library parameters {n_lib:,} (formula {count_params(cfg.model):,})")

    twin = None
    if args.vs_torch:
        twin = torch_twin(cfg, jax.device_get(state["params"]), host_batches)
        if twin is None:
            print("--vs-torch: torch is not importable here; skipped")
        else:
            print(f"torch twin parameters {twin[1]:,} (torch {twin[2].__version__}, "
                  f"{twin[2].get_num_threads()} threads){'' if twin[1] == n_lib else '  MISMATCH'}")

    hand = None
    if not args.no_hand:
        hand_params = jax.tree.map(jnp.copy, state["params"])
        opt, hand_step = hand_step_fn(cfg, hand_params)
        hand = [hand_params, opt.init(hand_params)]

    tol = 1e-4 if args.dtype == "float32" else 2e-2
    variants = {f"library {n}": [variant_step(n, cfg, mesh, state, batches[0], trainer.frozen),
                                 jax.tree.map(jnp.copy, state)]
                for n, on in (("before", args.before), ("no chunks", args.no_chunks), ("einsum", args.einsum),
                              ("rope fused", args.rope_fused)) if on}
    if args.scan_remat:
        variants["library scan+remat"] = scan_remat_step(cfg, mesh, state, batches[0])
    ran = trainer.spec.optimizer.parallel_parts  # "auto" resolved
    for n in args.also_parts:
        if n == ran:
            print(f"--also-parts {n}: the library's own step runs {n} part(s) (its row is 'library')")
    for n in sorted({1, *args.also_parts} - {ran}) if ran > 1 or args.also_parts else ():
        other = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"parallel_parts": n})})
        compiled = make_trainer(other, mesh).train_step.lower(state, batches[0]).compile()
        variants["library one part" if n == 1 else f"library {n} parts"] = [
            compiled if trainer.frozen is None else _Frozen(compiled, trainer.frozen), jax.tree.map(jnp.copy, state)]
    if variants:  # each variant must be its own program, or its row times the library (or another variant) again
        texts = {"library": trainer.train_step.lower(state, batches[0]).compile().as_text(),
                 **{name: v[0].as_text() for name, v in variants.items()}}
        if len(set(texts.values())) != len(texts):
            raise SystemExit(f"variants compiled to the same program: {sorted(texts)}")
        print(f"compiled programs differ: {', '.join(texts)}")
    state, m = trainer.train_step(state, batches[0])
    lib_l = float(m["loss"])
    firsts = {}
    for name, v in variants.items():
        v[1], mb = v[0](v[1], batches[0])
        firsts[name] = float(mb["loss"])
    if hand is not None:
        hand[0], hand[1], hl = hand_step(hand[0], hand[1], batches[0])
        firsts["hand-written"] = float(hl)
    if twin is not None:
        firsts["torch"] = float(twin[0]().detach())
    for name, v in firsts.items():
        agree = abs(lib_l - v) <= tol * abs(lib_l)
        print(f"first-step loss: library {lib_l:.6f}  {name} {v:.6f}  "
              f"({'agree' if agree else 'DISAGREE'} within {tol:g} relative)")

    def library_round(bs):
        nonlocal state
        for b in bs:
            state, mm = trainer.train_step(state, b)
        jax.block_until_ready((state, mm))

    def hand_round(bs):
        for b in bs:
            hand[0], hand[1], hl = hand_step(hand[0], hand[1], b)
        jax.block_until_ready((hand, hl))

    def torch_round(bs):
        for _ in bs:
            twin[0]()

    def variant_round(v, bs):
        for b in bs:
            v[1], mm = v[0](v[1], b)
        jax.block_until_ready((v[1], mm))

    rounds = {"library": library_round}
    for name, v in variants.items():
        rounds[name] = functools.partial(variant_round, v)
    if hand is not None:
        rounds["hand-written"] = hand_round
    if twin is not None:
        rounds["torch eager"] = torch_round
    for fn in rounds.values():  # settle compile caches, allocators and thread pools of every step
        fn(batches)
    times, cpu = timed_rounds(rounds, batches, args.rounds)

    tokens = cfg.batch_size * cfg.seq_len
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    peak, peak_src = device_peak(mesh.devices.flat, args.peak_tflops)
    print(cpu_line())
    print(f"device {jax.devices()[0].device_kind}; model d={args.d_model} L={args.layers} H={cfg.model.attention.n_heads} "
          f"T={cfg.seq_len} B={cfg.batch_size} {args.dtype}; {fpt / 1e6:.1f} MFLOP/token; MFU vs {peak_src}")
    print(f"library: {trainer.spec.optimizer.parallel_parts} part(s) a micro-batch (optimizer.parallel_parts="
          f"{cfg.optimizer.parallel_parts!r})")
    print(f"{'step':<16}{'ms/step':>10}{'tokens/s':>14}{'MFU':>8}{'CPU ms/step':>13}")
    rows = {}
    for name, ts in times.items():
        s = statistics.median(ts)
        rows[name] = tokens / s
        util = f"{fpt * tokens / s / peak:.1%}" if peak else "-"
        print(f"{name:<16}{s * 1e3:>10.1f}{tokens / s:>14,.0f}{util:>8}{statistics.median(cpu[name]) * 1e3:>13.1f}")
    per_round = {k: [a / b for a, b in zip(times[k], times["library"])] for k in times if k != "library"}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    for name, goal in (("hand-written", 0.95), ("library before", 1.0), ("library no chunks", 1.0),
                       ("library einsum", 1.0), ("library rope fused", 1.0), ("library one part", 1.0),
                       ("torch eager", 1.1)):
        if name in rows:
            print(f"ratio library / {name} tokens/s: {rows['library'] / rows[name]:.3f} "
                  f"(per round: {' '.join(f'{r:.2f}' for r in per_round[name])}; goal >= {goal}); "
                  f"CPU time per step {cpu_med[name] / cpu_med['library']:.3f}")
    one = "library one part" if "library one part" in rows else "library"  # the library's step in one part
    for name in (k for k in rows if k.endswith(" parts")):
        ratios = [b / a for a, b in zip(times[name], times[one])]
        print(f"ratio {name} / {one} (one part) tokens/s: {rows[name] / rows[one]:.3f} "
              f"(per round: {' '.join(f'{r:.2f}' for r in ratios)}); CPU time per step "
              f"{cpu_med[one] / cpu_med[name]:.3f}")
    if "library scan+remat" in rows:
        for name in ("library", "torch eager"):
            if name in rows and name != "library scan+remat":
                sr = times["library scan+remat"]
                print(f"ratio library scan+remat / {name} tokens/s: {rows['library scan+remat'] / rows[name]:.3f} "
                      f"(per round: {' '.join(f'{b / a:.2f}' for a, b in zip(sr, times[name]))}); "
                      f"CPU time per step {cpu_med[name] / cpu_med['library scan+remat']:.3f}")
    if "library before" in rows and "torch eager" in rows:
        print(f"ratio library before / torch eager tokens/s: {rows['library before'] / rows['torch eager']:.3f}; "
              f"CPU time per step {cpu_med['torch eager'] / cpu_med['library before']:.3f}")
    return rows


if __name__ == "__main__":
    restart_with_huge_pages()  # as jaxformer train runs (JAXFORMER_HUGE_PAGES=0: glibc's defaults)
    main()
