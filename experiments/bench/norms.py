"""LayerNorm vs RMSNorm, side by side in one run: the op alone (forward, forward+backward) and a whole
jitted train step of the main job's model with each norm (study 5: "RMSNorm is 10-15% faster").

Calls alternate (layernorm, rmsnorm, layernorm, ...) in rounds so drift on a shared machine hits both;
the table shows median times and the ratio RMSNorm / LayerNorm (below 1: RMSNorm faster).

    python experiments/bench/norms.py                 # CPU-sized default
    python experiments/bench/norms.py --quick         # toy sizes, one round (tests)
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from timing import cpu_line, timed

from jaxformer.ops.normalization import layer_norm, rms_norm
from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.corpus import build_corpus
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.step import make_trainer


def op_fns(shape):
    """Jitted forward and forward+backward of each norm on ``x [rows, D]`` with a learned scale and no
    bias (as in the train step's model, ``use_bias: false``): the difference is the mean subtraction."""
    D = shape[-1]
    key = jax.random.key(0)
    x = jax.random.normal(key, shape, jnp.float32)
    scale, bias = jnp.ones((D,)), jnp.zeros((D,))
    fwd = {"layernorm": jax.jit(lambda x, s, b: layer_norm(x, s)),
           "rmsnorm": jax.jit(lambda x, s, b: rms_norm(x, s))}

    def grad_of(f):
        return jax.jit(jax.grad(lambda x, s, b: jnp.sum(f(x, s, b) ** 2), argnums=(0, 1)))

    bwd = {k: grad_of(f) for k, f in fwd.items()}
    return (x, scale, bias), fwd, bwd


class TrainCase:
    """A jitted train step of ``config`` with ``overrides``, its state (seed 0) and one batch; calling it runs one
    step and returns the loss, threading the state through (the step donates it)."""

    def __init__(self, config: str, overrides: list[str]):
        self.cfg = C.load(config, [*overrides, "mesh.data=1"])
        self.trainer = make_trainer(self.cfg, S.make_mesh(self.cfg.mesh))
        self.state = self.trainer.init_state(0)
        it = TrainIterator(build_corpus(self.cfg.data), seq_len=self.cfg.seq_len, batch_size=self.cfg.batch_size,
                           seed=0)
        self.batch = S.put_batch(next(it), self.trainer.mesh)

    def __call__(self):
        self.state, m = self.trainer.train_step(self.state, self.batch)
        return m["loss"]


def step_fns(args) -> dict[str, TrainCase]:
    """The main job's model (stdlib_bytes.yaml) with each norm."""
    return {norm: TrainCase(args.config, [f"model.norm.kind={norm}", f"batch_size={args.batch}"])
            for norm in ("layernorm", "rmsnorm")}


def alternate(fns: dict, args_of, rounds: int, reps: int) -> tuple[dict, list[dict]]:
    """Median seconds per call of each function, timed in alternating rounds of ``reps`` calls, and each
    round's medians (for the spread of the ratio between rounds)."""
    times = {k: [] for k in fns}
    per_round = []
    for k, f in fns.items():  # compile + warm up
        jax.block_until_ready(f(*args_of(k)))
    for _ in range(rounds):
        this = {}
        for k, f in fns.items():
            ts = [timed(f, *args_of(k))[1] for _ in range(reps)]
            times[k] += ts
            this[k] = statistics.median(ts)
        per_round.append(this)
    return {k: statistics.median(v) for k, v in times.items()}, per_round


def iqr(xs: list[float]) -> tuple[float, float]:
    """The quartiles (numpy's linear interpolation) of ``xs``."""
    q1, q3 = np.percentile(np.asarray(xs, float), [25, 75])
    return float(q1), float(q3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/stdlib_bytes.yaml")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="toy sizes, one round")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    shapes = [(64, 32)] if args.quick else [(12 * 128, 128), (8192, 1024)]
    rows = []
    for shape in shapes:
        xsb, fwd, bwd = op_fns(shape)
        reps = 3 if args.quick else 20
        for what, fns in (("forward", fwd), ("forward+backward", bwd)):
            med, per = alternate(fns, lambda k: xsb, rounds, reps)
            rows.append((f"op {what}, x {list(shape)}", med["layernorm"], med["rmsnorm"], per))
    if args.quick:
        args.batch = 2
    steps = step_fns(args)

    med, per = alternate(steps, lambda k: (), rounds, 2 if args.quick else 5)
    cfg = steps["layernorm"].cfg
    rows.append((f"train step ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
                 f"{args.batch} x {cfg.seq_len} tokens)", med["layernorm"], med["rmsnorm"], per))

    print(cpu_line())
    print(f"{'what':58s} {'LayerNorm':>11s} {'RMSNorm':>11s} {'RMS/LN':>7s} {'per-round IQR':>15s}")
    for what, ln, rms, per in rows:
        q1, q3 = iqr([r["rmsnorm"] / r["layernorm"] for r in per])
        print(f"{what:58s} {ln * 1e3:9.3f}ms {rms * 1e3:9.3f}ms {rms / ln:7.3f} {f'[{q1:.3f}, {q3:.3f}]':>15s}")
    print(f"(median of {rounds} alternating rounds; RMS/LN per-round IQR: the quartiles of each round's ratio of "
          f"medians; {jax.default_backend()}, {jax.device_count()} device(s); numpy {np.__version__}, "
          f"jax {jax.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
