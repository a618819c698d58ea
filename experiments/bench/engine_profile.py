"""Where an engine step's time goes on the CPU, op by op: XLA's profile of ``Engine.step`` grouped by kind of op
and output shape, for the three steps the speed issues are about (SmolLM2-135M's shape, fp32):

- ``prefill``: one 512-token prompt in chunks of ``--chunk`` (``run_prompts``' default 256);
- ``batched-prefill``: 16 prompts of 128 tokens in chunks of 16 (the serving bench's steps that hold prefill);
- ``decode``: 16 sequences decoding one token each (the serving bench's batch-16 decode steps);
- ``decode-1``: one sequence decoding (``jaxformer generate`` with one prompt: the batch-1 figure).

    python experiments/bench/engine_profile.py [--scenario prefill batched-prefill decode decode-1] [--chunk 256]

Each scenario builds an engine, runs its steps once to compile, then traces them under ``jax.profiler`` with
``--xla_cpu_enable_xprof_traceme=true`` (set here before JAX starts). The op names are looked up in the HLO of
the step compiled for the traced step's own arguments (``engine_step`` is wrapped to record them), so each op
is named by its fusion kind and output shape (``ynn_fusion f32[256,1536]`` is a YNNPACK matmul with that
result). Times are op time summed over XLA's threads (2 on a 2-core box), per step: their total exceeds the
step's wall time, which is printed beside it.
"""

from __future__ import annotations

import os

TRACEME = "--xla_cpu_enable_xprof_traceme=true"
if TRACEME not in os.environ.get("XLA_FLAGS", "").split():  # once, however often this is imported (tests)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACEME}".strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import checkpoint_dir  # noqa: E402
from timing import cpu_line, hlo_outputs, xla_op_ns  # noqa: E402

import jaxformer.decode.engine as eng  # noqa: E402
from jaxformer.decode.sampling import SamplingParams  # noqa: E402
from jaxformer.interop.hf import load_pretrained  # noqa: E402

def scenario_engine(name: str, cfg, graphdef, state, chunk: int, rng) -> tuple[eng.Engine, int]:
    """A fresh engine holding the scenario's requests, and how many steps to trace."""
    if name == "prefill":
        e = eng.Engine(graphdef, state, cfg, page_size=16, max_batch=8, chunk_size=chunk, max_context=513)
        e.submit(list(map(int, rng.integers(3, cfg.vocab_size, 512))), SamplingParams(max_new_tokens=1,
                                                                                        temperature=0.0))
        return e, -(-512 // chunk)
    n_prompt, steps = (128, 4) if name == "batched-prefill" else (16, 8)
    n_seq = 1 if name == "decode-1" else 16
    e = eng.Engine(graphdef, state, cfg, page_size=16, max_batch=16, chunk_size=16, max_context=256)
    for _ in range(n_seq):
        e.submit(list(map(int, rng.integers(3, cfg.vocab_size, n_prompt))),
                 SamplingParams(max_new_tokens=64, temperature=0.0))
    if name.startswith("decode"):
        # one prefill step (a 16-token prompt is one chunk; it samples the first token), then 3 decode steps
        for _ in range(20):
            if e.running and all(len(r.generated) >= 4 for r in e.running):
                break
            e.step()
    return e, steps


def profile(name: str, cfg, graphdef, state, chunk: int):
    calls = []
    real = eng.engine_step

    def recording(*args):  # shapes only: the pools are donated, so their buffers are gone after the call
        model, leaves, pools, inputs, options = args
        calls.append((model, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           (leaves, pools, inputs)), options))
        return real(*args)

    rng = np.random.default_rng(0)
    e, steps = scenario_engine(name, cfg, graphdef, state, chunk, rng)
    eng.engine_step = recording
    try:
        for _ in range(steps):  # compiles every shape the traced steps use
            e.step()
        e, steps = scenario_engine(name, cfg, graphdef, state, chunk, np.random.default_rng(0))
        calls.clear()
        walls = []
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(steps):
                    t0 = time.perf_counter()
                    e.step()
                    walls.append(time.perf_counter() - t0)
            op_ns = xla_op_ns(d, steps)
    finally:
        eng.engine_step = real
    shapes = [tuple(a[3].tokens.shape) + (a[3].tables.shape[1],) for a in calls]
    # one compiled step per shape; two modules may share an op name (then the first module's shape is shown)
    hlo = "\n".join({(id(a[0]), sh): real.lower(*a).compile().as_text() for a, sh in zip(calls, shapes)}.values())
    out_shape = hlo_outputs(hlo)
    groups = collections.Counter()
    for op, ns in op_ns.items():
        kind = re.sub(r"[.\d]+$", "", op)
        groups[f"{kind} {out_shape.get(op, '?')}"] += ns
    return walls, groups, shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", nargs="+", default=["prefill", "batched-prefill", "decode"],
                    choices=["prefill", "batched-prefill", "decode", "decode-1"])
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the 'prefill' scenario")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args(argv)
    cfg, graphdef, state = load_pretrained(checkpoint_dir(os.path.join(tempfile.gettempdir(),
                                                                       "jaxformer_bench_smollm2_135m_random")))
    print(f"# Engine steps op by op (SmolLM2-135M shape, fp32)\n\n{cpu_line()}\n")
    for name in args.scenario:
        walls, groups, shapes = profile(name, cfg, graphdef, state, args.chunk)
        total = sum(groups.values())
        print(f"## {name}: {len(walls)} steps, wall ms each {[round(1e3 * w, 1) for w in walls]}; calls (B, T, M) "
              f"{sorted(set(shapes))}; op time per step {total / 1e6:.1f} ms (threads summed)\n")
        print("| op (kind, output) | ms per step | share |\n|---|---:|---:|")
        for k, ns in groups.most_common(args.top):
            print(f"| `{k}` | {ns / 1e6:.2f} | {ns / total:.0%} |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
