"""The GPU suite's shared pieces: its parts, titles and time boxes, datasheet peaks, and the child-side
reporting (:class:`Part`), timing (:func:`bench`) and input helpers every part uses."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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


