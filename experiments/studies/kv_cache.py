"""Study 10: the KV cache and PagedAttention. Claim: "a KV cache avoids recomputing history; paging
raises memory utilisation from under 60% to over 90% and multiplies throughput".

Two measurements, both ``experiments/bench/decode.py``'s own functions (no code copied):

* decode tokens/s with the KV cache vs recomputing the whole causal forward for every new token, at
  contexts 128 .. 2048 (``bench_cache_vs_recompute``: a 4-layer d_model 256 GQA model, batch 1, 16 new
  tokens, alternating timed runs);
* memory utilisation and concurrent sequences, contiguous (every sequence reserves the maximum length)
  vs paged (the real ``BlockManager``), over a lognormal length distribution (median 300, sigma 1,
  clipped to [16, 2048]) in a fixed budget of 32,768 token slots, at page sizes 8 .. 128
  (``bench_memory``). Concurrent sequences bound the batch a server can run, hence its throughput.

    python experiments/studies/kv_cache.py --out experiments/results/studies/kv_cache   # ~3 min, 2 cores
    python experiments/studies/kv_cache.py --dry-run
    python experiments/studies/kv_cache.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))

import decode as bench  # noqa: E402  (experiments/bench/decode.py)

CONTEXTS = (128, 256, 512, 1024, 2048)
PAGES = (8, 16, 32, 64, 128)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--quick", action="store_true", help="contexts 16, 32 with 2 new tokens; pages 16")
    ap.add_argument("--out", type=Path, help="directory for results.json, table.md and the plots")
    args = ap.parse_args(argv)
    contexts, pages, new = ((16, 32), (16,), 2) if args.quick else (CONTEXTS, PAGES, 16)
    if args.dry_run:
        print(f"cache vs recompute at contexts {contexts}, {new} new tokens; memory at page sizes {pages}")
        return 0
    decode_rows = []
    for c in contexts:
        _, s = bench.bench_cache_vs_recompute(context=c, new=new)
        decode_rows.append(dict(context=c, cache=s["cache_tokens_per_s"], recompute=s["recompute_tokens_per_s"]))
        print(f"context {c}: cache {s['cache_tokens_per_s']:.1f} tok/s, recompute {s['recompute_tokens_per_s']:.1f}",
              file=sys.stderr, flush=True)
    mem_rows, lengths = [], None
    for p in pages:
        _, s = bench.bench_memory(page=p)
        lengths = s["lengths"]
        mem_rows.append(dict(page=p, util_contig=s["util_contig"], util_paged=s["util_paged"],
                             n_contig=s["n_contig"], n_paged=s["n_paged"]))
    lines = ["| context | KV cache tokens/s | recompute tokens/s | speed-up |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['cache']:,.1f} | {r['recompute']:,.1f} | {r['cache'] / r['recompute']:.1f}x |"
              for r in decode_rows]
    lines += ["", "| page size | contiguous utilisation | paged utilisation | contiguous sequences | "
              "paged sequences | ratio |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['page']} | {r['util_contig']:.1%} | {r['util_paged']:.1%} | {r['n_contig']} | {r['n_paged']} | "
              f"{r['n_paged'] / r['n_contig']:.1f}x |" for r in mem_rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"decode": decode_rows, "memory": mem_rows}, indent=1))
        (args.out / "table.md").write_text(text + "\n")
        plot(decode_rows, mem_rows, lengths, args.out)
    return 0


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
    b.bar([i - width / 2 for i in pos], [r["util_contig"] for r in mem_rows], width, label="contiguous")
    b.bar([i + width / 2 for i in pos], [r["util_paged"] for r in mem_rows], width, label="paged")
    b.set_xticks(list(pos), ps)
    b.set_xlabel("page size (tokens)")
    b.set_ylabel("memory utilisation (real tokens / reserved slots)")
    for i, r in zip(pos, mem_rows):
        b.text(i + width / 2, r["util_paged"], f"{r['n_paged']} seqs", ha="center", va="bottom", fontsize=7)
        b.text(i - width / 2, r["util_contig"], f"{r['n_contig']} seqs", ha="center", va="bottom", fontsize=7)
    b.legend(fontsize=8)
    b.set_title("32,768 token slots: utilisation and concurrent sequences", fontsize=9)
    fig.savefig(out / "memory_utilisation.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    raise SystemExit(main())
