"""What the user sees: ``RUN_DIR/metrics.jsonl``, tensorboardX events in ``RUN_DIR/tb/``, a rich progress bar.

Train rows: ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", ...}``; eval
rows: ``{"step", "val_loss", "val_bpb", ...}``. On resume from step ``s`` the
rows after ``s`` (written by the interrupted run) are dropped and TensorBoard
purges them too, so the files read as one uninterrupted run.

MFU (model FLOPs utilisation) = model FLOPs per token (:func:`jaxformer.model.flops_per_token`,
forward + backward, the 6N + 12 L T d count) x tokens/s / the peak of the devices the run uses:
:func:`device_peak` finds it, in this order: ``logging.peak_tflops`` (per device) when given; the
vendor datasheet's dense bf16 peak for known GPUs and TPUs (:data:`DATASHEET_PEAK_TFLOPS`); on CPU a
1024^3 fp32 matmul, timed at start-up and again during the first steps of the run, the best of those probes
(:func:`measured_cpu_peak`): one probe, under whatever else runs on the machine's cores then, varied 2x
between identical runs. Unknown accelerators give no MFU. Each train row with an ``mfu`` also carries the
``peak_tflops`` it was computed against (all of the run's devices together).
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


# Dense (no sparsity) bf16 peak per device, TFLOP/s, from the vendors' datasheets, keyed by a lower-case
# prefix of ``jax.Device.device_kind``; the first match wins, so the specific kinds come first.
# NVIDIA lists H100/H200 SXM 1,979, H100 PCIe 1,513, H100/H200 NVL 1,671 and A100 624 TFLOP/s "with
# sparsity" (half of it dense); Google Cloud lists per chip v4 275, v5e 197, v5p 459, v6e 918.
DATASHEET_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("nvidia h100 pcie", 756.0),
    ("nvidia h100 nvl", 835.0),
    ("nvidia h200 nvl", 835.0),
    ("nvidia h100", 989.0),   # "NVIDIA H100 80GB HBM3" (SXM)
    ("nvidia h200", 989.0),
    ("nvidia a100", 312.0),   # SXM4 and PCIe, 40 and 80 GB
    ("tpu v4 lite", 0.0),     # v4i: inference chip, no published training peak -> no MFU
    ("tpu v4", 275.0),
    ("tpu v5 lite", 197.0),   # v5e
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),        # v5p reports "TPU v5"
    ("tpu v6 lite", 918.0),   # v6e (Trillium)
    ("tpu v6e", 918.0),
)


def datasheet_peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 datasheet peak (TFLOP/s per device) of ``device_kind``, or None when not in the table."""
    kind = device_kind.strip().lower()
    for prefix, tflops in DATASHEET_PEAK_TFLOPS:
        if kind.startswith(prefix):
            return tflops or None
    return None


def probe_cpu_matmul(n: int = 1024, min_calls: int = 5, max_calls: int = 60, budget_s: float = 0.25) -> float:
    """FLOP/s of an ``n^3`` fp32 matmul on the default CPU device: the best of at least ``min_calls`` timed
    calls (after a warm-up call), more while under ``budget_s`` seconds, at most ``max_calls``. The best of
    many short calls, not of a few: a run's own host threads (the data pipeline filling its buffer) can take
    a core for a few milliseconds, and 5 calls then measured one core of two (0.25 vs 0.49 TFLOP/s on a
    2-core box)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = _matmul()
    jax.block_until_ready(f(a))
    best, calls, start = math.inf, 0, time.perf_counter()
    while calls < min_calls or (calls < max_calls and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return 2.0 * n**3 / best


@functools.lru_cache(maxsize=1)
def _matmul():
    import jax

    return jax.jit(lambda x: x @ x)  # one function, so a probe after the first does not compile again


CPU_PROBES = 4
"""The most :func:`probe_cpu_matmul` probes one process makes: the start-up one and up to three more
during the first steps (:data:`REPROBE_AFTER_S`); later runs in the same process reuse the best."""

REPROBE_AFTER_S = (1.0, 4.0, 10.0)
"""Seconds after a run's first step at which the CPU peak is probed again (between steps, outside the timed
intervals): spread out, so that one of the probes finds the cores idle."""

_cpu_probes: list[float] = []  # every probe this process made


def measured_cpu_peak(*, again: bool = False) -> float:
    """The best FLOP/s of the CPU matmul probes this process made (:func:`probe_cpu_matmul`); the first call
    probes, ``again=True`` probes once more unless :data:`CPU_PROBES` were made already."""
    if not _cpu_probes or (again and len(_cpu_probes) < CPU_PROBES):
        _cpu_probes.append(probe_cpu_matmul())
    return max(_cpu_probes)


def cpu_probes() -> int:
    """How many CPU peak probes this process made (the figure :func:`measured_cpu_peak` is the best of)."""
    return len(_cpu_probes)


def peak_is_measured(devices, override_tflops: float | None = None) -> bool:
    """Whether :func:`device_peak` measures the peak (CPU devices, no ``logging.peak_tflops``)."""
    return override_tflops is None and next(iter(devices)).platform == "cpu"


def device_peak(devices, override_tflops: float | None = None) -> tuple[float | None, str]:
    """``(peak FLOP/s of all of ``devices`` together, where the figure comes from)``; ``(None, why)`` when unknown.

    ``override_tflops`` is the peak of one device, or on CPU of one process: the CPU devices of a
    process (``jax_num_cpu_devices``) share its cores, so there the peak counts processes, not devices.
    """
    devices = list(devices)
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        units, unit = len({d.process_index for d in devices}), "process"
        if override_tflops is None:
            peak = measured_cpu_peak()
            best = f", best of {cpu_probes()} probes" if cpu_probes() > 1 else ""
            return peak * units, f"{peak / 1e12:.3f} TFLOP/s per {unit} (measured fp32 matmul{best})"
    else:
        units, unit = len(devices), "device"
    if override_tflops is not None:
        return override_tflops * 1e12 * units, f"{override_tflops:g} TFLOP/s per {unit} (logging.peak_tflops)"
    tflops = datasheet_peak_tflops(kind)
    if tflops is None:
        return None, f"no peak known for {kind!r}: set logging.peak_tflops for MFU"
    return tflops * 1e12 * units, f"{tflops:g} TFLOP/s per device ({kind}, datasheet dense bf16)"


def mfu(flops_per_token: float, tokens_per_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops_per_token * tokens_per_s / peak_flops`` (None if either is unknown)."""
    if tokens_per_s is None or not peak_flops:
        return None
    return flops_per_token * tokens_per_s / peak_flops


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume_step: int = 0,
                 enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        if self.path.exists():
            rows = [line for line in self.path.read_text().splitlines() if line.strip()]
            keep = [r for r in rows if _row_step(r) is not None and _row_step(r) <= resume_step]
            self.path.write_text("".join(r + "\n" for r in keep))
        self._f = self.path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, row: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, clean["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _row_step(line: str):
    try:
        return json.loads(line).get("step")
    except json.JSONDecodeError:
        return None


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def plain_console() -> Console:
    """A console that never wraps: a line longer than the terminal (or a log file's 80 columns) is
    never split mid-number."""
    return Console(soft_wrap=True)


def hms(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour: ``hms(72) == "1:12"``, ``hms(3725) == "1:02:05"``."""
    m, sec = divmod(max(0, round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class ProgressBar:
    """Step, loss, tokens/s, MFU (when known), ETA. Plain log lines instead when disabled or not on a terminal:
    ``step 50/2,250  loss 5.2817  4,612 tok/s  MFU 32.7%  elapsed 0:12  ETA 9:10``, where elapsed counts from
    ``started`` (a ``clock()`` reading; default: now) and the ETA extrapolates the time per step since the first
    update (the first step, which compiles, is not counted; pauses for checkpoints and evaluations are, as
    they recur)."""

    def __init__(self, total: int, start: int, *, enabled: bool, show: bool = True,
                 console: Console | None = None, clock=time.perf_counter, started: float | None = None):
        self.show = show
        self.console = console or plain_console()
        self.rich = enabled and self.console.is_terminal
        self.enabled = enabled
        self.total = total
        self._clock = clock
        self._started = clock() if started is None else started
        self._first: tuple[float, int] | None = None  # (time, step) of the first update
        self._bar = None
        if self.rich:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[mfu]}"), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", tps="-", mfu="")
            self._bar.start()

    def eta(self, step: int, now: float) -> float | None:
        """Seconds left at ``step``: the steps still to run at the mean time per step since the first update."""
        if self._first is None or step <= self._first[1]:
            return None
        t, s = self._first
        return (self.total - step) * (now - t) / (step - s)

    def update(self, step: int, loss: float, tokens_per_s: float | None, log: bool,
               mfu: float | None = None) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (now, step)
        tps = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        util = "" if mfu is None else f"MFU {mfu:.1%}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", tps=tps, mfu=util)
        elif self.enabled and log:
            eta = self.eta(step, now)
            self.console.print(f"step {step:,}/{self.total:,}  loss {loss:.4f}  {tps} tok/s"
                               + (f"  {util}" if util else "")
                               + f"  elapsed {hms(now - self._started)}  ETA {'-' if eta is None else hms(eta)}",
                               highlight=False)

    def print(self, text: str) -> None:
        if not self.show:
            return
        if self._bar is not None:
            self._bar.console.print(text, highlight=False)
        else:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
