"""Study 10: the KV cache and PagedAttention. Claim: "a KV cache avoids recomputing history; paging
raises memory utilisation from under 60% to over 90% and multiplies throughput".

Three measurements, all ``experiments/bench/decode.py``'s own functions (no code copied):

* decode tokens/s with the KV cache vs recomputing the whole causal forward for every new token, at
  contexts 128 .. 2048 (``bench_cache_vs_recompute``: a 4-layer d_model 256 GQA model, batch 1, 16 new
  tokens, alternating timed runs);
* memory utilisation and concurrent sequences, contiguous (every sequence reserves the maximum length)
  vs paged (the real ``BlockManager``), over a lognormal length distribution (median 300, sigma 1,
  clipped to [16, 2048]) in a fixed budget of 32,768 token slots, at page sizes 8 .. 128
  (``bench_memory``): utilisation over all 100,000 draws, for seeds 0-4 (the spread is over seeds), and
  how many of the first draws fit the budget each way;
* the throughput claim: the continuous-batching engine's output tokens/s at one memory budget, paged vs
  ``reserve="context"`` (each admitted sequence holds its whole context of pages, as a contiguous cache
  does), on the same requests (``bench_paged_vs_reserved``), for a small model and a 59x larger one.

    python experiments/studies/kv_cache.py --out experiments/results/studies/kv_cache   # ~8 min, 2 cores
    python experiments/studies/kv_cache.py --dry-run
    python experiments/studies/kv_cache.py --quick
    python experiments/studies/kv_cache.py --table-from experiments/results/studies/kv_cache   # table.md again
    python experiments/studies/kv_cache.py --plots-from experiments/results/studies/kv_cache   # the plots again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))

import decode as bench  # noqa: E402  (experiments/bench/decode.py)

CONTEXTS = (128, 256, 512, 1024, 2048)
PAGES = (8, 16, 32, 64, 128)
SEEDS = (0, 1, 2, 3, 4)
# (label, d_model, layers, requests): the engine bench's small model, and one whose weights (~100 MB fp32) a
# decode step must stream, as a real model's are
ENGINES = (("d_model 128, 2 layers", 128, 2, 512), ("d_model 512, 8 layers", 512, 8, 256))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--quick", action="store_true", help="contexts 16, 32 with 2 new tokens; pages 16")
    ap.add_argument("--out", type=Path, help="directory for results.json, table.md and the plots")
    ap.add_argument("--table-from", type=Path, metavar="DIR",
                    help="write DIR/table.md again from DIR/results.json, running nothing")
    ap.add_argument("--plots-from", type=Path, metavar="DIR",
                    help="draw DIR's plots again from DIR/results.json, running nothing (the length histogram is "
                         "the first seed's draw again: a seeded random draw, no measurement)")
    args = ap.parse_args(argv)
    if args.table_from:
        print(rerender(args.table_from))
        return 0
    if args.plots_from:
        replot(args.plots_from)
        return 0
    contexts, pages, new = ((16, 32), (16,), 2) if args.quick else (CONTEXTS, PAGES, 16)
    seeds = SEEDS[:2] if args.quick else SEEDS
    engines = ((("d_model 64, 1 layer", 64, 1, 8),) if args.quick else ENGINES)
    if args.dry_run:
        print(f"cache vs recompute at contexts {contexts}, {new} new tokens; memory at page sizes {pages}, seeds "
              f"{seeds}; paged vs reserved engine throughput: {', '.join(e[0] for e in engines)}")
        return 0
    decode_rows = []
    for c in contexts:
        _, s = bench.bench_cache_vs_recompute(context=c, new=new)
        decode_rows.append(dict(context=c, cache=s["cache_tokens_per_s"], recompute=s["recompute_tokens_per_s"]))
        print(f"context {c}: cache {s['cache_tokens_per_s']:.1f} tok/s, recompute {s['recompute_tokens_per_s']:.1f}",
              file=sys.stderr, flush=True)
    mem_rows, lengths = [], None
    for p in pages:
        per_seed = [bench.bench_memory(seed=seed, page=p)[1] for seed in seeds]
        lengths = per_seed[0]["lengths"]
        row = dict(page=p, n_contig=per_seed[0]["n_contig"])
        for key in ("util_contig", "util_paged", "util_contig_fit", "n_paged"):
            vals = [float(s[key]) for s in per_seed]
            row[key], row[key + "_min"], row[key + "_max"] = sum(vals) / len(vals), min(vals), max(vals)
        mem_rows.append(row)
    engine_rows = []
    for name, d_model, layers, n in engines:
        kw = dict(n_requests=n, max_context=64, budget_tokens=256, rounds=1) if args.quick else dict(n_requests=n)
        _, s = bench.bench_paged_vs_reserved((d_model, layers), **kw)
        engine_rows.append(dict(model=name, params=s["params"], requests=n, tokens=s["tokens"],
                                tokens_per_s=s["tokens_per_s"], ratio=s["ratio"], mean_running=s["mean_running"],
                                peak_running=s["peak_running"], steps=s["steps"], preemptions=s["preemptions"],
                                seconds=s["seconds"], budget_tokens=s["budget_tokens"],
                                max_context=s["max_context"]))
        print(f"{name}: paged {s['tokens_per_s']['pages']:.0f} tok/s, reserved {s['tokens_per_s']['context']:.0f} "
              f"tok/s ({s['ratio']:.2f}x)", file=sys.stderr, flush=True)
    cpu = bench.cpu_line()  # once: it holds the load average, and results.json must match table.md
    text = render(decode_rows, mem_rows, engine_rows, seeds, cpu)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"cpu": cpu, "seeds": list(seeds),
                                                           "decode": decode_rows, "memory": mem_rows,
                                                           "engine": engine_rows}, indent=1))
        (args.out / "table.md").write_text(text + "\n")
        plot(decode_rows, mem_rows, lengths, args.out)
        if engine_rows:
            plot_engine(engine_rows, args.out)
    return 0


def _ms_per_step(row: dict, mode: str) -> float:
    """An engine row's milliseconds per step in ``mode``: its median timed round over its step count."""
    return 1e3 * statistics.median(row["seconds"][mode]) / row["steps"][mode]


def render(decode_rows: list[dict], mem_rows: list[dict], engine_rows: list[dict], seeds, cpu: str) -> str:
    """The study's tables (``table.md``) from its rows, as ``results.json`` keeps them."""
    lines = ["| context | KV cache tokens/s | recompute tokens/s | speed-up |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['cache']:,.1f} | {r['recompute']:,.1f} | {r['cache'] / r['recompute']:.1f}x |"
              for r in decode_rows]
    lines += ["", f"Utilisation over all 100,000 draws, mean over seeds {list(seeds)} [min, max]; sequences that fit "
              "32,768 slots (the first draws, admitted in order); contiguous utilisation of just those 16 "
              "sequences in the last column (the old page's figure).", "",
              "| page size | contiguous utilisation | paged utilisation | contiguous sequences | "
              "paged sequences [min, max] | ratio | contiguous, first 16 only [min, max] |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['page']} | {r['util_contig']:.1%} [{r['util_contig_min']:.1%}, {r['util_contig_max']:.1%}] | "
              f"{r['util_paged']:.1%} [{r['util_paged_min']:.1%}, {r['util_paged_max']:.1%}] | {r['n_contig']} | "
              f"{r['n_paged']:.1f} [{r['n_paged_min']:.0f}, {r['n_paged_max']:.0f}] | "
              f"{r['n_paged'] / r['n_contig']:.1f}x | {r['util_contig_fit']:.1%} [{r['util_contig_fit_min']:.1%}, "
              f"{r['util_contig_fit_max']:.1%}] |" for r in mem_rows]
    if engine_rows:
        e0 = engine_rows[0]
        lines += ["", f"Engine output tokens/s at one budget ({e0['budget_tokens']:,} tokens of pages of 16, context "
                  f"{e0['max_context']}), paged vs reserving the context per sequence; the same greedy requests "
                  "(outputs equal), median of the timed rounds:", "",
                  "| model | parameters | requests | new tokens | paged tok/s | reserved tok/s | paged / reserved | "
                  "sequences at once, mean (peak): paged | reserved | steps: paged | reserved | ms per step (median "
                  "round / steps): paged | reserved | preemptions |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['params']:,} | {r['requests']} | {r['tokens']:,} | "
                  f"{r['tokens_per_s']['pages']:,.0f} | {r['tokens_per_s']['context']:,.0f} | {r['ratio']:.2f}x | "
                  f"{r['mean_running']['pages']:.1f} ({r['peak_running']['pages']}) | "
                  f"{r['mean_running']['context']:.1f} ({r['peak_running']['context']}) | {r['steps']['pages']:,} | "
                  f"{r['steps']['context']:,} | {_ms_per_step(r, 'pages'):.1f} | {_ms_per_step(r, 'context'):.1f} | "
                  f"{r['preemptions']['pages']} |" for r in engine_rows]
    return cpu + "\n\n" + "\n".join(lines)


def rerender(out: Path) -> str:
    """``out``'s ``table.md`` written again from its ``results.json`` (a table format change needs no re-run);
    the CPU line from the results, or else from the old table's first line."""
    res = json.loads((out / "results.json").read_text())
    cpu = res.get("cpu") or (out / "table.md").read_text().splitlines()[0]
    text = render(res["decode"], res["memory"], res["engine"], res.get("seeds", SEEDS), cpu)
    (out / "table.md").write_text(text + "\n")
    return text


def replot(out: Path) -> None:
    """``out``'s plots drawn again from its ``results.json``; the length histogram is the first seed's draw
    again (``draw_lengths``, the draw ``bench_memory`` makes: seeded, no measurement)."""
    res = json.loads((out / "results.json").read_text())
    seed = list(res.get("seeds", SEEDS))[0]
    plot(res["decode"], res["memory"], bench.draw_lengths(seed, 100_000, max_len=2048), out)
    if res.get("engine"):
        plot_engine(res["engine"], out)


# one colour per allocation in every plot: contiguous (each sequence holds its whole context) and paged
CONTIGUOUS_COLOUR, PAGED_COLOUR = "C0", "C1"


def plot(decode_rows, mem_rows, lengths, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    xs = [r["context"] for r in decode_rows]
    ax.plot(xs, [r["cache"] for r in decode_rows], marker="o", label="KV cache")
    ax.plot(xs, [r["recompute"] for r in decode_rows], marker="o", label="full recompute per token")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.legend()
    ax.set_title("Decoding with and without the KV cache")
    fig.savefig(out / "cache_vs_recompute.png", dpi=110)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    a.hist(lengths, bins=60, color="C2")
    a.set_xlabel("sequence length (tokens)")
    a.set_ylabel("count (of 100,000 draws)")
    a.set_title("lengths: lognormal, median 300, clipped [16, 2048]", fontsize=9)
    ps = [str(r["page"]) for r in mem_rows]
    width = 0.38
    pos = range(len(ps))
    b.bar([i - width / 2 for i in pos], [r["util_contig"] for r in mem_rows], width, label="contiguous",
          color=CONTIGUOUS_COLOUR)
    b.bar([i + width / 2 for i in pos], [r["util_paged"] for r in mem_rows], width, label="paged",
          color=PAGED_COLOUR)
    b.set_xticks(list(pos), ps)
    b.set_xlabel("page size (tokens)")
    b.set_ylabel("memory utilisation (real tokens / reserved slots)")
    for i, r in zip(pos, mem_rows):
        b.text(i + width / 2, r["util_paged"], f"{r['n_paged']:.0f} seqs", ha="center", va="bottom", fontsize=7)
        b.text(i - width / 2, r["util_contig"], f"{r['n_contig']} seqs", ha="center", va="bottom", fontsize=7)
    b.set_ylim(0, 1.15)
    b.legend(fontsize=8, loc="upper center", ncol=2)
    b.set_title("32,768 token slots: utilisation over all draws (mean of seeds)\n"
                "and the sequences that fit (labels)", fontsize=9)
    fig.savefig(out / "memory_utilisation.png", dpi=110)
    plt.close(fig)


def plot_engine(engine_rows, out: Path) -> None:
    """One panel per model (their tokens/s differ tenfold): paged and reserved tokens/s, the median round as
    the bar and each timed round as a dot, and the paged / reserved ratio (median, and round by round, the
    rounds paired in the order they alternated) in the panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(engine_rows), figsize=(5 * len(engine_rows), 4.4), layout="constrained",
                             squeeze=False)
    allocations = (("pages", "paged", PAGED_COLOUR), ("context", "reserved (contiguous)", CONTIGUOUS_COLOUR))
    for ax, r in zip(axes[0], engine_rows):
        for x, (key, name, colour) in enumerate(allocations):
            ax.bar(x, r["tokens_per_s"][key], 0.6, label=name, color=colour)
            rounds = [r["tokens"] / s for s in r["seconds"][key]]
            ax.plot([x] * len(rounds), rounds, "o", color="black", markersize=3,
                    label="each timed round" if x == 0 else None)
            ax.text(x, max([r["tokens_per_s"][key], *rounds]), f"{r['mean_running'][key]:.0f} at once",
                    ha="center", va="bottom", fontsize=8)
        per_round = [c / p for p, c in zip(r["seconds"]["pages"], r["seconds"]["context"])]
        ax.set_xticks([0, 1], [a[1] for a in allocations])
        ax.set_ylabel("engine output tokens/s (greedy)")
        ax.set_ylim(0, 1.15 * max(r["tokens"] / s for k in ("pages", "context") for s in r["seconds"][k]))
        ax.set_title(f"{r['model']}, {r['params'] / 1e6:.1f} M parameters\npaged / reserved {r['ratio']:.2f}x "
                     f"(rounds {min(per_round):.2f}-{max(per_round):.2f})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    r0 = engine_rows[0]
    fig.suptitle(f"One KV budget ({r0['budget_tokens']:,} tokens), paged vs reserving the context "
                 f"({r0['max_context']}); own y scale per model", fontsize=9)
    fig.savefig(out / "engine_throughput.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    raise SystemExit(main())
