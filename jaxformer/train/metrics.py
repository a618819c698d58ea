"""What the user sees: ``RUN_DIR/metrics.jsonl``, tensorboardX events in ``RUN_DIR/tb/``, a rich progress bar.

Train rows: ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", ...}``; eval
rows: ``{"step", "val_loss", "val_bpb", ...}``. On resume from step ``s`` the
rows after ``s`` (written by the interrupted run) are dropped and TensorBoard
purges them too, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


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


class ProgressBar:
    """Step, loss, tokens/s, ETA. Plain log lines instead when disabled or not on a terminal."""

    def __init__(self, total: int, start: int, *, enabled: bool, show: bool = True,
                 console: Console | None = None):
        self.show = show
        self.console = console or plain_console()
        self.rich = enabled and self.console.is_terminal
        self.enabled = enabled
        self._bar = None
        if self.rich:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", tps="-")
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float | None, log: bool) -> None:
        tps = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", tps=tps)
        elif self.enabled and log:
            self.console.print(f"step {step}  loss {loss:.4f}  {tps} tok/s", highlight=False)

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
