"""Study 11's plot: validation bits/byte against trainable parameters (log scale), the base model as a line.

    python experiments/lora_plot.py runs/sweeps/lora runs/sweeps/lora-base OUT.png

``runs/sweeps/lora``: the sweep's output (``summary.jsonl``); ``runs/sweeps/lora-base``: the learning-rate-0
LoRA run that scores the base model (B stays 0, so the model is the base exactly; see the study page).
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(sweep: str, base_run: str, out: str) -> None:
    rows = [json.loads(line) for line in (Path(sweep) / "summary.jsonl").read_text().splitlines()]
    base = [json.loads(line) for line in (Path(base_run) / "metrics.jsonl").read_text().splitlines()]
    base_bpb = next(r["val_bpb"] for r in reversed(base) if "val_bpb" in r)
    arms: dict[str, list[dict]] = {}
    for r in rows:
        arms.setdefault(r["name"].rsplit("_seed-", 1)[0], []).append(r)
    full = next(rs[0]["params"] for rs in arms.values() if rs[0]["values"]["model.lora"] is None)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rs in arms.items():
        lora = rs[0]["values"]["model.lora"]
        trainable = full if lora is None else rs[0]["params"] - full  # a LoRA row's params: base + adapter
        vals = [r["val_bpb"] for r in rs]
        label = "full fine-tune" if lora is None else (
            f"LoRA r{lora['rank']}" + (" attention only" if lora.get("targets") else " all projections"))
        ax.errorbar(trainable, statistics.fmean(vals), yerr=statistics.stdev(vals), fmt="o", capsize=4,
                    label=f"{label} ({trainable:,})")
    ax.axhline(base_bpb, color="grey", ls="--", label=f"base model, no adaptation ({base_bpb:.4f})")
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters (log scale)")
    ax.set_ylabel("validation bits/byte (mean ± sd over 3 seeds)")
    ax.set_title("SmolLM2-135M adapted to the stdlib corpus, 24,576 tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
