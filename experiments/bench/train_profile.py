"""Where a train step's time goes, by op class, in the library (XLA's CPU profile) and its PyTorch twin (torch.profiler).

The companion of ``train_throughput.py`` (same model, batches and optimiser; ``--vs-torch`` there gives the
ratio of whole steps): this one says which class of op the difference is made of. Run it on one core so
that an op's time is its CPU time in both frameworks:

    taskset -c 1 python experiments/bench/train_profile.py                      # nanoGPT shape (d 256, L 4)
    taskset -c 1 python experiments/bench/train_profile.py --d-model 128 --heads 4 --seq-len 128 --batch 12

The library's ops come from ``jax.profiler`` with ``--xla_cpu_enable_xprof_traceme=true`` (set here
before JAX starts), each named after its HLO instruction; an op whose instruction (or fused computation)
holds a dot is a matmul, and its FLOPs are read off the dot's shapes (so GFLOP/s per class is printed).
Matmuls are split by who runs them: XLA's YNNPACK fusions or its Eigen dots (what XLA falls back to, e.g.
for a dot whose operands it transposed). PyTorch's ops are grouped by aten name.

A line above the table says how busy the step keeps the threads: of the traced span, the share with no XLA op
running, one, and two or more (``timing.ops_running``). Unpinned (XLA's 2-thread pool on 2 cores) that is where a
step loses to two cores; the "none" share also holds the Eigen dots' contractions, which run in Eigen's pool
outside their traced launch when XLA has more than one thread (their traced time at 2 threads is a fifth of their
one-core time). The "one" share is taken apart by op (``timing.ops_alone``): the ops that run with nothing else
traced beside them, by class and the longest by name. A YNNPACK product may still hand part of its work to the
other thread untraced (a lone ``[768, 128] x [128, 512]`` product runs 1.5x faster on 2 threads than on one, on
a 2-core Zen 2), so time with one op running is not an idle core; it is where a step depends on one op at a time.

Pinned to one core, with torch, a last block bounds what a change to the library's step could give against
torch's (``--goal``, the ratio a goal asks for), its products' FLOPs as they are: every product is charged at the
best product rate measured in the same run (XLA's and torch's ``[2048, 2048]`` product and the model's products in
their three forms, :func:`model_products`), and the block prints the library / torch ratio the step would reach if
nothing but products took time, the ratio with its other ops as measured, and how little time the other ops would
have to take to reach the goal (:func:`bound`, which lists what it assumes). The rate is the best any kernel
reached here, not the core's FMA limit: the bound says what the kernels at hand allow.

``--products`` times the model's projections alone, at one part's rows, in XLA and torch side by side: each in
its forward, input-gradient and weight-gradient form (:data:`FORMS`). Run pinned and unpinned, it says which
products gain less from the second thread in one framework than in the other.
"""

from __future__ import annotations

import os

TRACEME = "--xla_cpu_enable_xprof_traceme=true"
if TRACEME not in os.environ.get("XLA_FLAGS", "").split():  # once, however often this is imported (tests, a restart)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACEME}".strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

import train_throughput as tt  # noqa: E402
from jaxformer.train import config as C  # noqa: E402
from jaxformer.train import sharding as S  # noqa: E402
from jaxformer.train.corpus import build_corpus  # noqa: E402
from jaxformer.train.pipeline import TrainIterator  # noqa: E402
from jaxformer.train.step import make_trainer  # noqa: E402
from timing import cpu_line, hlo_outputs, op_ns_per_step, ops_alone, ops_running, wall_times, xla_op_events  # noqa: E402
from jaxformer.train.host_memory import restart_with_huge_pages  # noqa: E402

def _shapes(hlo: str) -> dict[str, list[int]]:
    return {m[1]: [int(d) for d in m[2].split(",") if d] for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo)}


def _dot_flops(text: str, shapes) -> int:
    """2 x output elements x contracted length, summed over the dots of an HLO instruction or computation."""
    total = 0
    for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} dot\(%?([\w.\-]+), [^)]*\),[^\n]*?lhs_contracting_dims=\{([\d,]*)\}",
                         text):
        lhs = shapes.get(m[2])
        if lhs is not None:
            out = [int(d) for d in m[1].split(",") if d]
            total += 2 * math.prod(out) * math.prod(lhs[int(c)] for c in m[3].split(",") if c)
    return total


class HloIndex:
    """A compiled step's optimised HLO, read once: each instruction's line, each computation's body, each value's shape."""

    def __init__(self, hlo: str):
        self.shapes = _shapes(hlo)
        self.bodies = {m[1]: m[2] for m in re.finditer(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}
        self.lines = {m[1]: m[2] for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", hlo, re.M)}
        self.outputs = hlo_outputs(hlo)

    def line(self, name: str) -> str:
        return self.lines.get(name, "")

    def output(self, name: str) -> str:
        """The op's output shape (:func:`timing.hlo_outputs`), '?' for a name not in the HLO."""
        return self.outputs.get(name, "?")

    def classify(self, name: str) -> tuple[str, int]:
        """``(class, flops)`` of the op ``name`` (an HLO instruction, maybe a fusion calling a computation)."""
        line = self.line(name)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = self.bodies.get(called[1], "") if called else ""
        flops = _dot_flops(body or "= " + line, self.shapes) if " dot(" in (body or line) else 0
        if flops:
            cls = "matmul, YNNPACK fusions" if name.startswith("ynn") else "matmul, Eigen dots"
        elif re.search(r"\b(transpose|copy)\(", body or line):
            cls = "transposes and copies"
        elif re.search(r"\b(exponential|tanh|erf|divide)\(", body or line):
            cls = "elementwise with exp/tanh/divide (softmax, GELU)"
        else:
            cls = "other elementwise and reductions"
        return cls, flops


def classify_xla(op_ns: dict[str, int], index: HloIndex) -> dict[str, list[float]]:
    """``{class: [ns, flops]}`` for the profiled ops of a compiled step (``index`` of its HLO)."""
    out = collections.defaultdict(lambda: [0.0, 0.0])
    for name, ns in op_ns.items():
        cls, flops = index.classify(name)
        out[cls][0] += ns
        out[cls][1] += flops
    return out


def alone_rows(alone_ns: dict[str, float], index: HloIndex, top: int):
    """``(rows, by_class)``: the ``top`` ops by time run alone as ``(name, class, output shape, ns)``, and the
    time run alone summed by class over every op."""
    rows, by_class = [], collections.Counter()
    for rank, (name, ns) in enumerate(sorted(alone_ns.items(), key=lambda kv: -kv[1])):
        cls = index.classify(name)[0]
        by_class[cls] += ns
        if rank < top:
            rows.append((name, cls, index.output(name), ns))
    return rows, by_class


def profile_library(cfg, mesh, batch, steps: int, top: int = 12):
    trainer = make_trainer(cfg, mesh)
    state = trainer.init_state()
    compiled = trainer.train_step.lower(state, batch).compile()
    for _ in range(2):
        state, m = compiled(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                state, m = compiled(state, batch)
            jax.block_until_ready(state)
        events = xla_op_events(d)
    span = (max(e for _, e, _ in events) - min(s for s, _, _ in events)) / steps
    index = HloIndex(compiled.as_text())
    alone = alone_rows({k: v / steps for k, v in ops_alone(events).items()}, index, top)
    return (classify_xla(op_ns_per_step(events, steps), index), ops_running(events), span,
            trainer.spec.optimizer.parallel_parts, alone)


def profile_torch(step, steps: int):
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out = collections.defaultdict(float)
    for ev in prof.key_averages():
        name = ev.key
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            cls = f"matmul ({name})"
        elif "scaled_dot_product" in name:
            cls = "attention (scaled_dot_product_attention, outside its matmuls)"
        elif name.startswith("Optimizer.step") or "adamw" in name.lower():
            cls = "optimizer step"
        else:
            continue
        out[cls] += ev.self_cpu_time_total * 1e3 / steps  # us -> ns
    total = sum(ev.self_cpu_time_total for ev in prof.key_averages()) * 1e3 / steps
    out["everything else (elementwise, norms, copies, autograd)"] = total - sum(out.values())
    return out, torch.get_num_threads()


FORMS = {
    "x @ w": ("[{m},{k}] x [{k},{n}]", lambda m, k, n: (k, n), lambda jnp, a, b: a @ b, lambda a, b: a.mm(b)),
    "dy @ w^T": ("[{m},{k}] x [{n},{k}]^T", lambda m, k, n: (n, k), lambda jnp, a, b: a @ b.T,
                 lambda a, b: a.mm(b.t())),
    "x^T @ dy": ("[{m},{k}]^T x [{m},{n}]", lambda m, k, n: (m, n), lambda jnp, a, b: a.T @ b,
                 lambda a, b: a.t().mm(b)),
}
"""A 2-D product's forms in a train step, ``(label, second operand's shape, XLA's, torch's)`` for a first operand
``[m, k]``: the forward ``x @ w``, the input gradient ``dy @ w^T`` and the weight gradient ``x^T @ dy``
(contracting the rows of both operands: XLA's CPU backend leaves it to Eigen, YNNPACK taking only a row-major left
operand contracted over its last axis). Each is ``2 m k n`` FLOPs."""


PRODUCT_CALLS = 25
"""Timed calls of each product in :func:`product_rates` (its best is the rate): the peak and the products table."""


def product_rates(products, calls: int = PRODUCT_CALLS, with_torch: bool = True) -> dict[str, float]:
    """``{"who label": FLOP/s}`` of fp32 products ``(form, m, k, n)`` (:data:`FORMS`), by XLA (jitted) and, with
    ``with_torch`` where it is importable, by torch, each the best of ``calls`` timed calls after a warm-up
    (:func:`timing.wall_times`), at the threads this process runs with (pinned to one core: one). A call each: XLA's
    includes its dispatch (tens of microseconds), which a product inside a compiled step does not pay."""
    import jax.numpy as jnp
    import numpy as np

    torch = None
    if with_torch:
        try:
            import torch
        except ImportError:
            pass
    rates = {}
    for form, m, k, n in products:
        label, second, xla_fn, torch_fn = FORMS[form]
        a = np.random.default_rng(0).random((m, k), np.float32)
        b = np.random.default_rng(1).random(second(m, k, n), np.float32)
        f = jax.jit(functools.partial(xla_fn, jnp))
        runs = {"xla": (f, jnp.asarray(a), jnp.asarray(b))}
        if torch is not None:
            runs["torch"] = (torch_fn, torch.from_numpy(a), torch.from_numpy(b))
        for who, (fn, x, y) in runs.items():
            best = min(wall_times(fn, x, y, warmup=1, repeats=calls))
            rates[f"{who} {label.format(m=m, k=k, n=n)}"] = 2.0 * m * k * n / best
    return rates


def best_rate(rates: dict[str, float]) -> tuple[str, float]:
    """``(name, FLOP/s)`` of the fastest product in ``rates``: the rate the bound charges every product at."""
    return max(rates.items(), key=lambda kv: kv[1])


def model_products(d_model: int, rows: int) -> list[tuple[str, tuple[str, int, int, int]]]:
    """``(name, (form, m, k, n))`` for the projections of a GPT-2 block of width ``d_model`` over ``rows`` tokens
    (QKV, attention output, MLP up and down), each in the three forms of :data:`FORMS`."""
    d = d_model
    out = []
    for name, (i, o) in (("qkv", (d, 3 * d)), ("attention out", (d, d)), ("mlp up", (d, 4 * d)),
                         ("mlp down", (4 * d, d))):
        out += [(f"{name} forward", ("x @ w", rows, i, o)), (f"{name} input gradient", ("dy @ w^T", rows, o, i)),
                (f"{name} weight gradient", ("x^T @ dy", rows, i, o))]
    return out


def bound(lib: dict[str, tuple[float, float]], torch_ns: float, peak: float, goal: float) -> dict[str, float]:
    """What the library's step could reach against torch's on one core, from its op classes ``lib`` (``{class:
    (ns, FLOPs)}`` a step, :func:`classify_xla`), torch's step ``torch_ns`` and the core's matmul ``peak`` (FLOP/s):
    ``products_at_peak_ms`` (the products' FLOPs at the peak), ``other_ms`` (every op without a product, as
    measured), ``best`` (torch's time over the products' at the peak: the ratio if nothing else took time),
    ``best_with_other`` (the same with the other ops as measured) and ``other_budget_ms`` (what the other ops may
    take for library / torch to reach ``goal`` with every product at the peak; negative: not even then).

    Assumed, and printed with it: the products' FLOPs as the step has them (an op's dots counted once, as the
    profile's op is; no dot in a loop); what a product's fusion does besides its dot counted as product time; op
    time on one core as the step's time, torch's its profiled ops' total. The peak is the best product rate
    measured in the run, not the core's FMA limit: a kernel faster than any measured would move the bound."""
    flops = sum(fl for _, fl in lib.values())
    other = sum(ns for ns, fl in lib.values() if not fl)
    at_peak = flops / peak * 1e9
    return {"products_at_peak_ms": at_peak / 1e6, "other_ms": other / 1e6, "best": torch_ns / at_peak,
            "best_with_other": torch_ns / (at_peak + other), "other_budget_ms": (torch_ns / goal - at_peak) / 1e6}


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def products_table(products, rates: dict[str, float], rows: int, cores: int) -> None:
    """Print ``products`` (:func:`model_products`) with their XLA and torch rates from ``rates``."""
    print(f"the model's products alone ({rows} rows: one part's), GFLOP/s at {cores} core(s), the best of "
          f"{PRODUCT_CALLS} calls each:")
    print(f"{'product':<30}{'shape':<28}{'XLA':>8}{'torch':>8}{'XLA / torch':>13}")
    for name, (form, m, k, n) in products:
        label = FORMS[form][0].format(m=m, k=k, n=n)
        x, t = rates[f"xla {label}"], rates.get(f"torch {label}")
        print(f"{name:<30}{label:<28}{x / 1e9:>8.1f}" + (f"{t / 1e9:>8.1f}{x / t:>13.2f}" if t else ""))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the fields ``train_throughput.experiment`` reads (fp32, XLA attention)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    p.add_argument("--no-torch", action="store_true", help="no torch at all: neither its step nor its products")
    p.add_argument("--top", type=int, default=12, help="how many of the ops that run alone longest to list")
    p.add_argument("--parts", type=int, help="optimizer.parallel_parts (default 'auto', as the library trains)")
    p.add_argument("--products", action="store_true",
                   help="also time the model's projections alone (forward, input and weight gradient, one part's "
                        "rows) in XLA and torch (unless --no-torch) at this run's threads: run it pinned and "
                        "unpinned for each one's gain from the second thread")
    p.add_argument("--goal", type=float, default=1.3,
                   help="the library / torch ratio the bound block asks after (issue 23: 1.3 at nanoGPT's shape, "
                        "1.1 at the main job's); the block is printed pinned to one core, with torch")
    args = p.parse_args(argv)
    args.dtype, args.attention = "float32", "xla"
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = tt.experiment(args)
    mesh = S.make_mesh(cfg.mesh)
    it = TrainIterator(build_corpus(C.DataConfig()), seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=0)
    host = next(it)
    lib, running, span, parts, (alone, alone_by_class) = profile_library(cfg, mesh, S.put_batch(host, mesh),
                                                                          args.steps, args.top)
    torch_rows, threads, b = {}, None, None
    rows = cfg.batch_size * cfg.seq_len // parts  # one part's: the products the step runs
    products = model_products(args.d_model, rows)
    if not args.no_torch:
        state = make_trainer(cfg, mesh).init_state()
        twin = tt.torch_twin(cfg, jax.device_get(state["params"]), [host])
        if twin is None:
            print("torch is not importable here: the library's side only")
        else:
            torch_rows, threads = profile_torch(twin[0], args.steps)
    print(cpu_line())
    print(f"model d={args.d_model} L={args.layers} T={cfg.seq_len} B={cfg.batch_size} float32; op CPU time per step, "
          f"median-free sum over {args.steps} profiled steps / {args.steps}"
          + (f"; torch {threads} thread(s)" if threads else ""))
    print(f"library: {parts} part(s) a micro-batch; traced span {span / 1e6:.1f} ms a step, with XLA ops running "
          f"at once: none {running[0]:.1%}, one {running[1]:.1%}, two or more {running[2]:.1%} (none: the runtime's "
          f"gaps, and Eigen dots' contractions, traced for their launch only when XLA has more than one thread)")
    print("time with one XLA op running, by the op's class, ms a step: "
          + ", ".join(f"{cls} {ns / 1e6:.1f}" for cls, ns in alone_by_class.most_common()))
    print(f"the {len(alone)} ops the library runs alone longest, ms a step:")
    for name, cls, shape, ns in alone:
        print(f"  {ns / 1e6:>7.2f}  {name:<40} {shape:<24} {cls}")
    print(f"{'library op class (XLA)':<52}{'ms':>9}{'GFLOP/s':>9}")
    for cls, (ns, fl) in sorted(lib.items(), key=lambda kv: -kv[1][0]):
        print(f"{cls:<52}{ns / 1e6:>9.1f}{(f'{fl / ns:.0f}' if fl else '-'):>9}")
    lib_total = sum(ns for ns, _ in lib.values())
    print(f"{'total':<52}{lib_total / 1e6:>9.1f}")
    if torch_rows:
        print(f"{'torch op class':<52}{'ms':>9}")
        for cls, ns in sorted(torch_rows.items(), key=lambda kv: -kv[1]):
            print(f"{cls:<52}{ns / 1e6:>9.1f}")
        print(f"{'total':<52}{sum(torch_rows.values()) / 1e6:>9.1f}")
        rates = product_rates([("x @ w", 2048, 2048, 2048)] + [p for _, p in products])
        best, peak = best_rate(rates)
        cores = _cores()
        print(f"matmul peak on {cores} core(s): {peak / 1e9:.1f} GFLOP/s, the best product rate measured here "
              f"({best}; of XLA's and torch's [2048]^3 product and the model's {len(products)} products at {rows} rows)")
        if cores == 1 and threads == 1:
            b = bound(lib, sum(torch_rows.values()), peak, args.goal)
            print(f"bound (one core): the library's products at that rate {b['products_at_peak_ms']:.1f} ms, its other "
                  f"ops {b['other_ms']:.1f} ms a step; library / torch at most {b['best']:.2f} if nothing but "
                  f"products took time, {b['best_with_other']:.2f} with the other ops as measured; for "
                  f"{args.goal:.2f} the other ops "
                  + (f"may take at most {b['other_budget_ms']:.1f} ms" if b["other_budget_ms"] >= 0 else
                     "could take no time at all and still not reach it")
                  + " (op time on one core; the products' FLOPs as compiled; not the core's FMA limit)")
        else:
            print("bound: pin the run to one core (taskset -c 1) for the bound against the measured peak")
        if args.products:
            products_table(products, rates, rows, cores)
    elif args.products:
        products_table(products, product_rates([p for _, p in products], with_torch=False), rows, _cores())
    return {"library": {k: v[0] for k, v in lib.items()}, "torch": dict(torch_rows), "running": running,
            "alone": alone, "alone_by_class": dict(alone_by_class), "bound": b}


if __name__ == "__main__":
    restart_with_huge_pages()  # as jaxformer train runs (JAXFORMER_HUGE_PAGES=0: glibc's defaults)
    main()
