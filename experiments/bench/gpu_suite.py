"""The whole GPU check in one command: correctness, attention and decode speed, a train step, a block sweep.

    python experiments/bench/gpu_suite.py --out experiments/results/        # on the GPU: ~5 minutes
    python experiments/bench/gpu_suite.py --parts b,e --out experiments/results/   # rerun some parts
    python experiments/bench/gpu_suite.py --dry-run                         # CPU, toy sizes, interpret mode

Parts, in this order, each in its own subprocess with its own time box (a part past its box is
killed and reported, and the suite goes on; inside a part, a case is not started when the box
cannot hold it):

  a  correctness on the device: ``pallas_kernels`` flash forward + dq/dk/dv (causal, window, GQA,
     ALiBi, softcap, segments, ragged lengths; fp32/bf16), the block-sparse path (Longformer /
     BigBird operands, a per-head tile map) and paged decode, each against the package's own
     oracle (``flash_attention.reference``, ``paged_attention_reference``; a dense masked softmax
     written here for the block-sparse masks), compiled (interpret mode only under --dry-run).
  b  flash attention TFLOP/s, forward and forward+backward, bf16, head dims 128 and 64, lengths
     8k and 2k (B*T = 16k tokens, 16 heads), causal and not, beside cuDNN and XLA
     (``jax.nn.dot_product_attention``), JAX's Pallas Triton ``mha`` and JAX's Pallas Mosaic GPU
     (Hopper) ``attention``; the anchors that do not exist or do not run here are reported as such.
  c  paged decode: GB/s of K/V read at batch 64, contexts 2k/4k/8k, 32 query heads on 8 kv heads,
     H=128, pages of 16 shuffled, against a device-to-device copy of the same bytes, JAX's Pallas
     paged attention, and a contiguous-cache decode (``jax.nn.dot_product_attention`` xla / cudnn).
  d  a ``gpt2_small``-shaped bf16 train step (jaxformer.model + optax AdamW): tokens/s and MFU
     against the device's dense bf16 peak (datasheet) and a matmul measured in the same run,
     ``attention_impl`` pallas vs xla. Needs flax, optax and pydantic; without them it names the
     wheels to carry and is skipped. Parts a-c and e import only jax and pallas_kernels.
  e  a small block-size sweep of the flash kernel (forward, dq and dk/dv tiles separately), the
     best per shape written out as a proposed block-size table.

Output: one markdown file (``--out DIR`` gives ``DIR/gpu_suite.md``; a dry run writes
``gpu_suite_dryrun.md``, by default in the temp directory). Rows are appended as they are
measured, so a killed part still leaves what it had finished; a rerun appends a new run section.
The first line of each run is a header: device, JAX version, Python, date.

Runs from the source tree (the repository root goes on ``sys.path``) on any JAX >= 0.10.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PARTS = ("a", "b", "c", "d", "e")
TITLES = {
    "a": "correctness on the device (kernels vs their references)",
    "b": "flash attention TFLOP/s vs cuDNN, XLA and JAX's Pallas kernels",
    "c": "paged decode bandwidth vs copy, JAX's paged kernel and a contiguous cache",
    "d": "gpt2_small-shaped bf16 train step: tokens/s and MFU, attention_impl pallas vs xla",
    "e": "flash block-size sweep (proposed table)",
}
# Seconds per part on one H200 (about 5 minutes together, process start-up included);
# a dry run gets generous boxes: on a busy CPU the interpret-mode kernels set the pace.
BOXES = {"a": 50, "b": 100, "c": 30, "d": 75, "e": 35}
DRY_BOXES = {p: 120 for p in PARTS}
STATUS_TAG = "@@gpu_suite_status "
HEADER_TAG = "@@gpu_suite_header "

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, without sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,  # SXM; the H200 NVL is 835
    "H100 80GB HBM3": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "A100": 312.0,
    "L40S": 362.0,
}
# Wheels part (d) needs beyond jax (pydantic's own dependencies included).
D_WHEELS = {"pydantic": "pydantic pydantic-core annotated-types typing-inspection typing-extensions",
            "flax": "flax (>= 0.12) and its dependencies", "optax": "optax", "jaxtyping": "jaxtyping"}


def peak_bf16(device_kind: str) -> float | None:
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in device_kind:
            if name == "H200" and "NVL" in device_kind:
                return 835.0
            return tflops
    return None


# =========================================================================== child side: reporting


class Part:
    """What a part's subprocess writes: lines to stdout (relayed by the parent) and to the output file."""

    def __init__(self, letter: str, out: str, dry: bool, box_s: float, full: bool = False, skip=()):
        self.letter, self.out, self.dry = letter, out, dry
        self.skip = set(skip)  # anchors of (b) and (c) not to run (--skip)
        self.tracing = dry and not full  # a dry run traces most cases; --full runs them all
        self.t0 = time.perf_counter()
        self.box_s = box_s
        self.longest = 0.0  # the longest case so far: a case is started only when the box can hold one more
        self.fails: list[str] = []
        self.not_run: list[str] = []
        self.ran = 0

    def line(self, text: str = "", file_too: bool = True) -> None:
        print(text, flush=True)
        if file_too:
            with open(self.out, "a") as f:
                f.write(text + "\n")

    def console(self, text: str) -> None:
        self.line(text, file_too=False)

    def left(self) -> float:
        return self.box_s - (time.perf_counter() - self.t0)

    def room(self, what: str) -> bool:
        """True when the box holds another case as long as the longest so far (plus a margin)."""
        need = 1.2 * self.longest + 1.0
        if self.left() < need:
            self.not_run.append(what)
            return False
        return True

    def case(self, fn, *args, **kwargs):
        """Run one case; its wall time updates :attr:`longest`. Exceptions propagate."""
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.ran += 1
            self.longest = max(self.longest, time.perf_counter() - t)

    def error(self, what: str, e: BaseException) -> str:
        """One-line description of ``e`` (the traceback's tail goes to the console only)."""
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:160]
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        self.console("    " + "".join(tb[-3:]).replace("\n", "\n    ")[:1500])
        self.console(f"    ^ {what}")
        return msg.replace("|", "/")

    def finish(self, status: str | None = None, summary: str = "") -> None:
        if self.not_run:
            self.line(f"\nNot run (time box {self.box_s:.0f} s): {', '.join(self.not_run)}")
        status = status or ("failed" if self.fails else ("partial" if self.not_run else "ok"))
        if self.fails:
            self.line("\nFailures:\n" + "\n".join(f"- {f}" for f in self.fails))
        print(STATUS_TAG + json.dumps({"status": status, "summary": summary,
                                       "seconds": round(time.perf_counter() - self.t0, 1)}), flush=True)


def bench(fn, *args, dry: bool = False, trace: bool = False):
    """``(median seconds per call, seconds of the first call incl. compile)``.

    Calls are enqueued back to back and blocked on at the end, so dispatch overlaps the device:
    ``n`` calls per repeat, sized from one timed call (after two warm-up calls) to ~0.1 s per repeat
    (3 repeats). ``dry``: one timed call. ``trace``: ``jax.eval_shape`` only (a dry run's cheap check of the call), NaN seconds.
    """
    import jax

    if trace:
        jax.eval_shape(fn, *args)
        return float("nan"), 0.0
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    if dry:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t, first
    jax.block_until_ready(fn(*args))  # JAX 0.11 may do one-time work on the second call of a jitted function
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    est = time.perf_counter() - t
    n = max(1, min(200, int(0.1 / max(est, 1e-6))))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times), first


def rel_err(got, want) -> float:
    """``max|got - want| / max(1, max|want|)`` in fp32, on the host (inf when ``got`` is not finite)."""
    import numpy as np

    g, w = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    if not np.isfinite(g).all():
        return float("inf")
    return float(np.max(np.abs(g - w))) / max(1.0, float(np.max(np.abs(w))))


def normal(seed: int, shape, dtype):
    """Standard normal ``shape`` in ``dtype``: drawn on the host when small (no compile per shape, which
    dominates a dry run), with ``jax.random`` on the device when large."""
    import jax
    import numpy as np

    if math.prod(shape) <= 1 << 20:
        x = np.random.default_rng(seed).standard_normal(shape, np.float32)
        return jax.numpy.asarray(x.astype(jax.numpy.dtype(dtype)))
    return jax.random.normal(jax.random.key(seed), shape, jax.numpy.float32).astype(dtype)


def to_f32(*xs):
    """fp32 copies (through the host for small arrays: no compile per shape)."""
    import jax.numpy as jnp
    import numpy as np

    return [jnp.asarray(np.asarray(x).astype(np.float32)) if x.size <= 1 << 20 else x.astype(jnp.float32)
            for x in xs]


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


# =========================================================================== (c) paged decode


def part_c(p: Part) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import gather_pages, paged_attention

    if p.dry:
        B, N, K, H, L, ctxs = 2, 4, 1, 16, 16, (32,)
    else:
        B, N, K, H, L, ctxs = 64, 32, 8, 128, 16, (2048, 4096, 8192)
    dtype = jnp.bfloat16
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except Exception as e:  # noqa: BLE001
        jax_paged = None
        p.line(f"- JAX's Pallas paged_attention: not available: {type(e).__name__}: {e}"[:160])
    p.line(f"Decode, B={B}, N={N} query heads on K={K} kv heads (GQA {N // K}:1), H={H}, pages of L={L} tokens "
           f"shuffled in the pool, bf16, every sequence at the full context. KV GB/s = K/V bytes of the pages in "
           "use / time; copy = read + write bytes / time of a device-to-device copy of both pools. "
           "'contig': jax.nn.dot_product_attention on a contiguous [B,S,K,H] cache (same data). "
           "err: max|ours - contig xla| / max(1, max|contig|).")
    if p.dry:  # both paged kernels at the GPU's largest context, lowered for CUDA
        gB, gM, gP = 64, 8192 // 16, 64 * (8192 // 16)
        specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in (
            ((gB, 32, 128), dtype), ((8, gP, 16, 128), dtype), ((8, gP, 16, 128), dtype), ((gB, gM), jnp.int32),
            ((gB,), jnp.int32))]
        dry_lowering(p, "ours, context 8192", lambda *a: paged_attention(*a, backend="gpu"), *specs)
        if jax_paged is not None:
            dry_lowering(p, "jax-pallas-paged, context 8192",
                         lambda *a: jax_paged.paged_attention(*a, k_splits=16), *specs)
    p.line("")
    cols = ["ours", "jax-pallas-paged", "contig-xla", "contig-cudnn"]
    p.line("| context | KV MiB | copy GB/s | " + " | ".join(f"{c} us" for c in cols)
           + " | ours KV GB/s | ours / copy | jax-pallas-paged / ours time | contig-xla / ours time | err |")
    p.line("|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    worst = None
    notes: dict[str, str] = {}  # first error of each anchor, listed below the table
    for ctx in ctxs:
        if not p.room(f"context {ctx}"):
            continue
        M = ctx // L
        P = B * M
        q = normal(10, (B, N, H), dtype)
        kp, vp = normal(11, (K, P, L, H), dtype), normal(12, (K, P, L, H), dtype)
        tables = jnp.asarray(rng.permutation(P).reshape(B, M), jnp.int32)
        lengths = jnp.full((B,), ctx, jnp.int32)
        kc, vc = gather_pages(kp, tables), gather_pages(vp, tables)  # [B, ctx, K, H]
        kv_bytes = 2 * B * ctx * K * H * jnp.dtype(dtype).itemsize
        fns = {
            "ours": (jax.jit(lambda q, kp, vp, t, n: paged_attention(q, kp, vp, t, n, backend="gpu",
                                                                       interpret=p.dry)), (q, kp, vp, tables, lengths)),
            "contig-xla": (jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="xla")[:, 0]), (q, kc, vc, lengths)),
            "contig-cudnn": (jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn")[:, 0]), (q, kc, vc, lengths)),
        }
        for name in p.skip & set(fns):
            del fns[name]
        if jax_paged is not None and "jax-pallas-paged" not in p.skip:
            splits = min(16, M)
            fns["jax-pallas-paged"] = (jax.jit(lambda q, kp, vp, t, n: jax_paged.paged_attention(
                q, kp, vp, t, n, k_splits=splits, interpret=p.dry)), (q, kp, vp, tables, lengths))
        secs, outs = {}, {}
        copy = jax.jit(lambda a, b: (jnp.copy(a), jnp.copy(b)))

        def measure():
            for name, (fn, args) in fns.items():
                try:
                    secs[name], first = bench(fn, *args, dry=p.dry)
                    outs[name] = fn(*args)
                    p.console(f"    context {ctx} {name}: {1e6 * secs[name]:.0f} us (first call {first:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    secs[name] = None
                    msg = p.error(f"{name} context {ctx}", e)
                    if name == "ours":
                        p.fails.append(f"ours context {ctx}: {msg}")
                    else:
                        notes.setdefault(name, f"context {ctx}: {msg}")
            return bench(copy, kp, vp, dry=p.dry)[0]

        t_copy = p.case(measure)
        copy_bw = 4 * kp.size * kp.dtype.itemsize / t_copy  # read + write, both pools
        err = rel_err(outs["ours"], outs["contig-xla"]) if "ours" in outs and "contig-xla" in outs else None
        tol = TOL_PAGED["bfloat16"]
        if err is not None and err > tol:
            p.fails.append(f"context {ctx}: ours differs from the contiguous xla decode: {err:.2e} > {tol}")
        t_ours = secs.get("ours")
        bw = None if t_ours is None else kv_bytes / t_ours
        frac = None if bw is None else bw / copy_bw
        worst = frac if worst is None or (frac is not None and frac < worst) else worst

        def us(x):
            return "-" if x is None else f"{1e6 * x:.0f}"

        def rt(a, b):
            return "-" if a is None or b is None else f"{a / b:.2f}"

        p.line(f"| {ctx} | {kv_bytes / 2**20:,.0f} | {copy_bw / 1e9:,.0f} | "
               + " | ".join(us(secs.get(c)) for c in cols)
               + f" | {'-' if bw is None else f'{bw / 1e9:,.0f}'} | {'-' if frac is None else f'{frac:.0%}'} | "
               f"{rt(secs.get('jax-pallas-paged'), t_ours)} | {rt(secs.get('contig-xla'), t_ours)} | "
               f"{'-' if err is None else f'{err:.1e}'} |")
    if notes:
        p.line("\nFirst error of each anchor:\n" + "\n".join(f"- {k}: {v}" for k, v in notes.items()))
    p.line("\nGoal (issue 16): paged decode >= 80% of copy bandwidth: "
           + ("-" if worst is None else f"worst {worst:.0%}, {'met' if worst >= 0.8 else 'NOT met'}"))
    p.finish(summary="-" if worst is None else f"worst {worst:.0%} of copy")


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
        from jaxformer.model.functional import apply
        from jaxformer.ops.losses import cross_entropy
    except Exception as e:  # noqa: BLE001 -- e.g. a flax too old for jaxformer
        p.line(f"Skipped: jaxformer.model does not import here: {p.error('import jaxformer.model', e)}")
        p.finish("skipped", "jaxformer.model does not import")
        return

    base = presets.gpt2_small().model_dump()
    if p.dry:
        B, T, steps = 2, 16, 2
        base.update(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=T)
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
    p.line(f"gpt2_small shape: {base['n_layers']} layers, d_model {base['d_model']}, {base['n_heads']} heads, "
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
        cfg = ModelConfig(**{**base, "compute_dtype": "bfloat16", "param_dtype": "float32", "attention_impl": impl,
                             "scan_layers": True})
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


# =========================================================================== (e) block-size sweep


# Candidates per kernel: tiles (block_q, block_k) at the table's warps/stages, then the table's tile at
# other launch settings (warps, stages); each kernel swept with the other two at the dispatcher's choice.
# Tiles the table does not hold have not been compile-checked for spills: check a winner with
# experiments/bench/gpu_compile.py before adopting it.
SWEEP_TILES = {"fwd": ((64, 64), (128, 128), (64, 128)),
               "dq": ((64, 64), (64, 128), (128, 128)),
               "dkv": ((64, 64), (32, 128), (128, 64), (32, 64))}
SWEEP_TILES_DRY = {"fwd": ((16, 16), (32, 16)), "dq": ((16, 16),), "dkv": ((16, 16),)}
SWEEP_LAUNCH = ((None, 3), ("other", 2))  # (warps: None = the table's, "other" = 4 <-> 8; stages)


def ms(t: float, spec: str = ".3f") -> str:
    """Seconds as milliseconds (``spec``), 'traced' for a NaN (a dry run's traced-only call)."""
    return "traced" if math.isnan(t) else format(1e3 * t, spec)


def _sweep_backend():
    """``pallas_kernels.block_table`` when it offers the dispatcher's table (lookup + overriding), else None
    (the sweep then passes ``block_sizes``: tiles only)."""
    try:
        from pallas_kernels import block_table
    except ImportError:
        return None
    need = ("lookup", "overriding", "gpu_arch", "head_dim_key", "dtype_key", "KernelConfig")
    return block_table if all(hasattr(block_table, n) for n in need) else None


def part_e(p: Part) -> None:
    import contextlib

    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import BlockSizes, flash_attention

    bt = _sweep_backend()
    if p.dry:
        shapes, N, tokens, tiles, launches = ((32, 64),), 2, 64, SWEEP_TILES_DRY, SWEEP_LAUNCH[:1]
    else:
        shapes, N, tokens, tiles, launches = ((128, 4096), (64, 4096)), 16, 16384, SWEEP_TILES, SWEEP_LAUNCH
    dtype = jnp.bfloat16
    arch = bt.gpu_arch() if bt else None
    p.line(f"bf16, causal, N={N}, B*T = {tokens} tokens. The forward's candidates timed on the forward; dq's and "
           "dk/dv's on forward+backward, the other kernels at the dispatcher's choice. "
           + (f"Candidates override entries of pallas_kernels.block_table (arch {arch}): tile, warps, stages. "
              if bt else "pallas_kernels.block_table not found: candidates are passed as block_sizes (tiles only). ")
           + "ms: median per call; 'vs table': the dispatcher's choice's time / this one's."
           + (" Dry run: the first two timings run (interpret mode), the rest are only traced." if p.tracing else ""))
    p.line("")
    p.line("| H | T | kernel | block_q, block_k, warps, stages | ms | vs table |")
    p.line("|---:|---:|---|---|---:|---:|")
    best = {}
    ran = [0]  # a dry run runs the first two timings and traces the rest

    def timing(fn, args, override):
        trace = p.tracing and ran[0] >= 2
        ran[0] += 1
        ctx = bt.overriding(override) if (bt and override) else contextlib.nullcontext()
        with ctx:  # the table is read when the call is traced, inside bench's first call
            return p.case(bench, fn, *args, dry=p.dry, trace=trace)[0]

    for H, T in shapes:
        B = max(1, tokens // T)
        q, k, v, do = (normal(30 + i, (B, T, N, H), dtype) for i in range(4))

        def fwd_fn(bs):
            return jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=bs, backend="gpu",
                                                           interpret=p.dry))

        def bwd_fn(bs):
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash_attention(
                q, k, v, causal=True, block_sizes=bs, backend="gpu", interpret=p.dry).astype(jnp.float32)
                * do.astype(jnp.float32)), argnums=(0, 1, 2)))

        Hp = max(16, 1 << (H - 1).bit_length())
        for kernel in ("fwd", "dq", "dkv"):
            make = fwd_fn if kernel == "fwd" else bwd_fn
            label = f"H={H} T={T} {kernel} table"
            if not p.room(label):
                continue
            if bt:
                key = (arch, bt.head_dim_key(Hp), bt.dtype_key(dtype), kernel)
                cur = bt.lookup(kernel, Hp, dtype, arch)
                now = (cur.block_q, cur.block_k, cur.num_warps, cur.num_stages)
            else:
                r = BlockSizes.default("gpu").resolved().as_dict()
                suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv"}[kernel]
                now = (r["block_q" + suffix], r["block_k" + suffix], None, None)
            try:
                t_def = timing(make(None), (q, k, v), None)
            except Exception as e:  # noqa: BLE001
                p.fails.append(f"{label}: {p.error(label, e)}")
                continue
            p.line(f"| {H} | {T} | {kernel} | table: {', '.join(map(str, now))} | {ms(t_def)} | 1.00 |")
            cands = [(bq, bk, now[2], now[3]) for bq, bk in tiles[kernel] if (bq, bk) != now[:2]]
            if bt:
                for warps, stages in launches:
                    w = now[2] if warps is None else (8 if now[2] == 4 else 4)
                    cands.append((now[0], now[1], w, stages))
            top = (t_def, now)
            for cand in cands:
                label = f"H={H} T={T} {kernel} {cand}"
                if not p.room(label):
                    continue
                try:
                    if bt:
                        t = timing(make(None), (q, k, v), {key: bt.KernelConfig(*cand)})
                    else:
                        r = BlockSizes.default("gpu").resolved().as_dict()
                        r.update({"block_q" + suffix: cand[0], "block_k" + suffix: cand[1]})
                        t = timing(make(BlockSizes(**r)), (q, k, v), None)
                except Exception as e:  # noqa: BLE001 -- e.g. a tile over the shared-memory budget
                    p.line(f"| {H} | {T} | {kernel} | {', '.join(map(str, cand))} | error: "
                           f"{p.error(label, e)[:80]} | |")
                    continue
                p.line(f"| {H} | {T} | {kernel} | {', '.join(map(str, cand))} | {ms(t)} | "
                       f"{'traced' if math.isnan(t) else f'{t_def / t:.2f}'} |")
                if t < top[0]:
                    top = (t, cand)
            best[(H, T, kernel)] = (top[1], now, None if math.isnan(t_def) else t_def / top[0])
    lines = ["", f"Best per shape{' (proposed block_table entries: paste into its generated block after a spill check)' if bt else ''}:",
             "", "```python"]
    for (H, T, kernel), (cand, now, gain) in best.items():
        if bt:
            key = (arch, bt.head_dim_key(max(16, 1 << (H - 1).bit_length())), "bf16", kernel)
            lines.append(f"    {key!r}: KernelConfig({', '.join(map(str, cand))}),  # x{gain or float('nan'):.2f} vs "
                         f"table {now} at T={T}, causal")
        else:
            lines.append(f"    ({H}, 'bf16', {kernel!r}): (block_q, block_k) = {cand[:2]},  # x{gain or float('nan'):.2f} "
                         f"vs default {now[:2]} at T={T}, causal")
    lines.append("```")
    p.line("\n".join(lines))
    p.finish(summary=f"{len(best)} kernel x shape entries swept")



# =========================================================================== header (written by the first part)


def header(dry: bool) -> dict:
    """Device, versions and date of this run; ``line`` is the one-line header."""
    import jax

    devs = jax.devices()
    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # noqa: BLE001
        jaxlib_version = "?"
    extras = ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'no'}"
                       for m in ("flax", "optax", "pydantic", "jaxtyping", "jax_triton", "triton"))
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = dict(backend=jax.default_backend(), device=devs[0].device_kind, n=len(devs), jax=jax.__version__,
                jaxlib=jaxlib_version, python=platform.python_version(), extras=extras, date=date)
    info["line"] = (f"gpu_suite | device: {info['device']} ({info['backend']} x{info['n']}) | JAX {info['jax']} "
                    f"(jaxlib {jaxlib_version}) | Python {info['python']} | {date} | "
                    + ("DRY RUN (CPU, interpret mode, toy sizes)" if dry else "compiled"))
    return info


def ensure_title(out: str) -> None:
    if not os.path.exists(out):
        with open(out, "w") as f:
            f.write("# GPU suite (issue 16)\n\nWritten by `experiments/bench/gpu_suite.py`: each run appends a section "
                    "(its first line the header: device, JAX, Python, date), each part its rows as they are "
                    "measured, then the part's status.\n")


def worker(args) -> int:
    part = Part(args.worker, args.out, args.dry_run, args.box_s, args.full, filter(None, args.skip.split(",")))
    if args.run_info:  # the first part of a run writes the run's header
        run = json.loads(args.run_info)
        info = header(args.dry_run)
        print(HEADER_TAG + json.dumps(info), flush=True)
        if not args.dry_run and info["backend"] != "gpu":  # nothing is written: results come from a GPU only
            print(info["line"], flush=True)
            return 2
        ensure_title(args.out)
        part.line(f"\n## Run: {info['line']}\n")
        part.line(f"`{run['command']}`; parts {run['parts']}; time boxes {run['boxes']}; packages: {info['extras']}.")
    part.line(f"\n### ({args.worker}) {TITLES[args.worker]}\n")
    {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}[args.worker](part)
    return 1 if part.fails else 0


# =========================================================================== parent


def run_child(args_list, box_s: float, env) -> tuple[bool, dict, dict, float, int | None]:
    """Run a worker, relay its lines, kill its whole process group at ``box_s`` seconds.

    Returns ``(killed, status, header info, seconds, returncode)``; status and info are {} when not printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args_list], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, cwd=ROOT,
                            start_new_session=True)
    status: dict = {}
    info: dict = {}

    def relay():
        for line in proc.stdout:
            if line.startswith(STATUS_TAG):
                status.update(json.loads(line[len(STATUS_TAG):]))
            elif line.startswith(HEADER_TAG):
                info.update(json.loads(line[len(HEADER_TAG):]))
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=box_s)
    except subprocess.TimeoutExpired:
        killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=5)
    return killed, status, info, time.perf_counter() - t0, proc.returncode


def parse_boxes(text: str | None, dry: bool) -> dict[str, float]:
    boxes = dict(DRY_BOXES if dry else BOXES)
    for item in filter(None, (text or "").split(",")):
        part, _, sec = item.partition("=")
        if part not in PARTS or not sec:
            raise SystemExit(f"--boxes wants PART=SECONDS,... with PART in {PARTS}; got {item!r}")
        boxes[part] = float(sec)
    return boxes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory (or .md file) for the report; default: "
                    "experiments/results/ on the GPU, the temp directory for --dry-run")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of parts to run (always in the order a-e)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, kernels in interpret mode")
    ap.add_argument("--full", action="store_true", help="with --dry-run: run every case (slow) instead of "
                    "running the first of each list and tracing the rest")
    ap.add_argument("--skip", default="", help="comma list of anchors not to run, e.g. jax-pallas-mgpu,contig-cudnn "
                    "(b: cudnn, xla, jax-pallas-triton, jax-pallas-mgpu; c: jax-pallas-paged, contig-xla, contig-cudnn)")
    ap.add_argument("--boxes", default=None, help="override time boxes in seconds, e.g. b=150,e=60")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--box-s", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-info", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise SystemExit(f"--parts: {bad or parts} not in {PARTS}")
    parts = [x for x in PARTS if x in parts]
    boxes = parse_boxes(args.boxes, args.dry_run)
    out = args.out or (tempfile.gettempdir() if args.dry_run else os.path.join(ROOT, "experiments", "results"))
    if not out.endswith(".md"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "gpu_suite_dryrun.md" if args.dry_run else "gpu_suite.md")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    out = os.path.abspath(out)

    # This process never imports jax: each part's subprocess owns the device (and its memory) alone.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.dry_run:
        env["JAX_PLATFORMS"] = "cpu"
        if "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):  # cheap CPU compiles (as tests/conftest.py)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 "
                                "--xla_llvm_disable_expensive_passes=true").strip()
    command = "python experiments/bench/gpu_suite.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run_info = json.dumps(dict(command=command.strip(), parts=",".join(parts),
                               boxes=", ".join(f"{x} {boxes[x]:g} s" for x in parts)))
    print(f"report: {out}", flush=True)

    results = []
    have_header = False
    t_all = time.perf_counter()
    for x in parts:
        cmd = ["--worker", x, "--out", out, "--box-s", str(boxes[x])] + (["--dry-run"] if args.dry_run else []) \
            + (["--full"] if args.full else []) + (["--skip", args.skip] if args.skip else [])
        if not have_header:
            cmd += ["--run-info", run_info]
        killed, status, info, secs, rc = run_child(cmd, boxes[x], env)
        if not have_header:
            if not info:  # the part died before its header: write one, so the file still says what ran
                ensure_title(out)
                with open(out, "a") as f:
                    f.write(f"\n## Run: gpu_suite (no header: part ({x}) ended before JAX started) | "
                            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}\n\n"
                            f"### ({x}) {TITLES[x]}\n")
            else:
                have_header = True
                if not args.dry_run and info["backend"] != "gpu":
                    print(f"gpu_suite: no GPU (jax.default_backend() is {info['backend']!r}); use --dry-run on a CPU",
                          file=sys.stderr)
                    return 2
        if killed:
            verdict, summary = "STOPPED", f"killed at its time box ({boxes[x]:g} s)"
        elif not status:
            verdict, summary = "CRASHED", f"exit code {rc}, no status"
        else:
            verdict = {"ok": "ok", "failed": "FAILED", "partial": "partial (time box)",
                       "skipped": "skipped"}.get(status["status"], status["status"])
            summary = status.get("summary", "")
        line = f"**({x}) {verdict}** in {secs:.1f} s: {summary}"
        with open(out, "a") as f:
            f.write(f"\n{line}\n")
        print(f"\n{line}", flush=True)
        results.append((x, verdict, secs, summary))

    table = ["", "| part | status | s | summary |", "|---|---|---:|---|"]
    table += [f"| {x} | {v} | {s:.1f} | {m} |" for x, v, s, m in results]
    table.append(f"\nTotal {time.perf_counter() - t_all:.1f} s.")
    with open(out, "a") as f:
        f.write("\n### Summary\n" + "\n".join(table) + "\n")
    print("\n### Summary\n" + "\n".join(table), flush=True)
    return 0 if all(v in ("ok", "skipped") for _, v, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
