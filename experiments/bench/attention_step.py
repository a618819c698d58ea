"""Where ``impl="auto"`` should switch from dense XLA to blockwise attention on CPU.

A whole jitted train step of the main job's model (``experiments/configs/stdlib_bytes.yaml``),
``model.attention_impl`` = xla vs blockwise, at several context lengths with the tokens per
step held fixed; steps are timed in alternating rounds (median of each), compile excluded.

    python experiments/bench/attention_step.py [--lengths 256 512 1024] [--tokens 3072] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import numpy as np
from timing import timed

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.packing import Batch
from jaxformer.train.step import make_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _batch(B: int, T: int) -> dict:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2:] = 2  # two packed documents per row
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None].repeat(B, 0).astype(np.int32)
    return Batch(tokens=toks[:, :-1], targets=toks[:, 1:], loss_mask=np.ones((B, T), bool), segment_ids=seg,
                 positions=pos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--tokens", type=int, default=3072, help="tokens per step (batch = tokens // T)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = os.path.join(ROOT, "experiments", "configs", "stdlib_bytes.yaml")
    print(f"train step of {os.path.relpath(path, ROOT)}, {args.tokens} tokens/step, "
          f"{jax.device_count()} device(s), backend {jax.default_backend()}")
    print("| T x batch | xla ms/step | blockwise ms/step | blockwise / xla |")
    print("|---|---:|---:|---:|")
    for T in args.lengths:
        B = max(1, args.tokens // T)
        steps, times = {}, {}
        for impl in ("xla", "blockwise"):
            cfg = C.load(path, [f"seq_len={T}", f"batch_size={B}", f"model.max_seq_len={T}",
                                f"model.attention.impl={impl}"])
            tr = make_trainer(cfg, S.make_mesh(cfg.mesh))
            state = tr.init_state(0)
            batch = S.put_batch(_batch(B, T), tr.mesh)
            state, m = tr.train_step(state, batch)  # compile
            jax.block_until_ready(m)
            steps[impl], times[impl] = [tr, state, batch], []
        for _ in range(args.rounds):
            for impl in ("xla", "blockwise"):
                tr, state, batch = steps[impl]
                (state, _), seconds = timed(tr.train_step, state, batch)
                times[impl].append(seconds)
                steps[impl][1] = state
        x, b = (statistics.median(times[k]) * 1e3 for k in ("xla", "blockwise"))
        print(f"| {T} x {B} | {x:,.0f} | {b:,.0f} | {b / x:.2f} |", flush=True)


if __name__ == "__main__":
    main()
