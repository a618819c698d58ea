"""Serving benchmark: ``jaxformer serve`` under load (Poisson arrivals and fixed concurrency) against the same
requests through ``jaxformer generate``'s path one after another, in one run.

In the style of vLLM's ``benchmark_serving.py``: a client (threads, raw HTTP streaming, one connection per
request) sends the requests of a fixed sample (prompt lengths uniform in [--min-prompt, --max-prompt] tokens,
output lengths uniform in [--min-out, --max-out]; random token ids, ``ignore_eos`` by construction: the
checkpoint has no EOS) to a real ``jaxformer serve`` process, as a Poisson process at each ``--rates``
(requests/s) and at a fixed ``--concurrency`` (that many in flight, the next sent when one ends). Per mode:
request throughput, output tokens/s, time to first token (TTFT), time per output token after the first
(TPOT, per request) and inter-token latency (ITL, every gap between streamed tokens), mean / median / p99, and
the requests that failed; first the same requests one at a time (an idle server: the TTFT baseline). Then,
in this process without HTTP: the same requests one after another on an engine of ``jaxformer generate``'s
geometry (its prefill chunks of ``GenerateOptions.chunk_size`` = 256 tokens: one prompt at a time, without
its process start and compilation) and all at once on one of the server's (the engine's own ceiling), each
also with ``feature_major=False`` (the engine's matmuls in the training layout: what the feature-major steps
gain), the engines taking turns for ``--repeats`` rounds (medians), with every engine step timed by kind.

The model: a random checkpoint of SmolLM2-135M's shape (a Llama, 30 layers, d 576, GQA 9:3, vocabulary
49,152) written by jaxformer's own ``save_pretrained`` with a word-level tokenizer (``t0 .. t49151``), or with
``--small`` a 4-layer d 256 one. Compilation is excluded: the server starts with ``--precompile`` (every step
shape compiled first) and is warmed up with the sample itself; the in-process engine compiles every shape
first too (:meth:`Engine.compile_all`).

    python experiments/bench/serve.py                       # print the table
    python experiments/bench/serve.py --write               # also experiments/results/serve_cpu.md
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cpu_line  # noqa: E402  (the CPU model, ISA flags, cores and load average)

from jaxformer.decode.prompts import GenerateOptions  # noqa: E402  (generate's prefill chunk: the baseline's)

SMOLLM2_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    hidden_act="silu")
SMALL = {**SMOLLM2_135M, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4}


def checkpoint(path: Path, hf: dict) -> Path:
    """A random checkpoint of config ``hf`` (seed 0) and a word-level tokenizer ``t0 .. t{V-1}``, written once."""
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxformer.interop.hf import config_from_hf, save_pretrained
    from jaxformer.model import init

    if (path / "tokenizer.json").is_file():
        return path
    config = config_from_hf(hf)
    _, state = init(config, jax.random.key(0))
    save_pretrained(path, config, state, hf_config=hf)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def sample_requests(n: int, vocab: int, prompt: tuple[int, int], out: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*prompt))], rng.randint(*out)) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, args: list[str]):
        import httpx

        self.url = f"http://127.0.0.1:{free_port()}"
        self.cmd = [sys.executable, "-m", "jaxformer.cli", "serve", "--hf", str(model), "--host", "127.0.0.1",
                    "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning", *args]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 1800  # --precompile: every step shape first
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready")
            time.sleep(0.5)

    def started(self) -> str:
        return next((line.strip() for line in Path(self.log.name).read_text().splitlines()
                     if line.startswith("jaxformer serve:")), "?")

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


def one_request(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: send time, each token's arrival time, error (None if it worked)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, stamps, text_tokens = time.perf_counter(), [], 0
    try:
        with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return dict(start=t0, stamps=[], error=f"HTTP {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return dict(start=t0, stamps=stamps, error=str(chunk["error"]))
                words = len(chunk["choices"][0]["text"].split())
                stamps += [time.perf_counter()] * words  # one word per token (the word-level tokenizer)
                text_tokens += words
    except httpx.HTTPError as e:
        return dict(start=t0, stamps=stamps, error=repr(e))
    err = None if text_tokens == max_tokens else f"{text_tokens} tokens of {max_tokens}"
    return dict(start=t0, stamps=stamps, error=err)


def run_poisson(url: str, requests, rate: float, seed: int = 1) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(requests))
    out: list[dict | None] = [None] * len(requests)
    threads = []
    t0 = time.perf_counter()
    due = t0
    for i, (prompt, n) in enumerate(requests):
        due += gaps[i]
        time.sleep(max(0.0, due - time.perf_counter()))
        t = threading.Thread(target=lambda i=i, p=prompt, n=n: out.__setitem__(i, one_request(url, p, n)))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def run_concurrent(url: str, requests, concurrency: int) -> tuple[list[dict], float]:
    out: list[dict | None] = [None] * len(requests)
    nxt, lock = iter(range(len(requests))), threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            out[i] = one_request(url, *requests[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["stamps"][0] - r["start"] for r in ok if r["stamps"]]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in ok if len(r["stamps"]) > 1]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(len(r["stamps"]) for r in ok)
    return dict(requests=len(results), failed=len(results) - len(ok), wall=wall, req_s=len(ok) / wall,
                tok_s=tokens / wall, ttft=ttft, tpot=tpot, itl=itl,
                errors=sorted({r["error"] for r in results if r["error"]})[:3])


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


def stats(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{1e3 * statistics.mean(xs):.0f} / {1e3 * statistics.median(xs):.0f} / {1e3 * p99(xs):.0f}"


def run_profiled(engine, profile: collections.Counter) -> dict:
    """``engine.run()``, timing every step into ``profile``: seconds and steps per kind, "decode B=b" (every row
    decoded one token; ``b`` the batch rows computed, a power of two) or "with prefill" (a prefill chunk in the
    step). Returns the engine's results."""
    while not engine.done:
        before, steps = engine.stats["tokens_computed"], engine.stats["steps"]
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if engine.stats["steps"] == steps:  # nothing ran (an empty plan)
            continue
        rows, new = engine.stats["batch_rows"], engine.stats["tokens_computed"] - before
        kind = f"decode B={rows}" if new <= rows else "with prefill"
        profile[kind, "s"] += dt
        profile[kind, "steps"] += 1
    return engine.results


def profile_lines(profiles: dict[str, collections.Counter]) -> list[str]:
    """A table of where each in-process run's engine time went, by step kind (:func:`run_profiled`)."""
    kinds = sorted({k for p in profiles.values() for k, _ in p}, key=lambda k: (k == "with prefill",
                                                                               int(k.split("=")[-1]) if "=" in k
                                                                               else 0))
    lines = ["| run | " + " | ".join(f"{k}: steps, ms each, s" for k in kinds) + " | total s |",
             "|---" * (len(kinds) + 2) + "|"]
    for name, p in profiles.items():
        cells = [f"{p[k, 'steps']}, {1e3 * p[k, 's'] / p[k, 'steps']:.0f}, {p[k, 's']:.2f}" if p[k, "steps"]
                 else "" for k in kinds]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(p[k, 's'] for k in kinds):.2f} |")
    return lines


def ceiling(seq: collections.Counter, together: collections.Counter, seq_s: float, rounds: int) -> float:
    """What the all-at-once run could reach against the one-after-another one (``seq_s`` seconds a round) if every
    batched decode step cost no more than a one-row step (``seq``'s ``decode B=1`` steps; :func:`run_profiled`'s
    counters, summed over ``rounds``): ``together``'s prefill seconds (its prefill steps, which also carry decode
    rows) plus its decode steps at the one-row step's time. A ceiling: on a CPU a 16-row step costs more."""
    if not seq["decode B=1", "steps"] or not rounds:
        raise ValueError("ceiling: the one-after-another profile has no one-row decode step")
    one = seq["decode B=1", "s"] / seq["decode B=1", "steps"]
    steps = sum(v for (k, f), v in together.items() if k.startswith("decode") and f == "steps") / rounds
    return seq_s / (together["with prefill", "s"] / rounds + steps * one)


def in_process(model: Path, requests, max_batch: int, max_context: int, chunk_size: int, repeats: int = 2) -> dict:
    """The requests without HTTP (every step shape compiled first, as the server's ``--precompile``): the
    default engine (feature-major steps on the CPU) and one with ``feature_major=False`` (every matmul in the
    training layout), taking turns, ``repeats`` rounds: one after another at ``jaxformer generate``'s prefill
    chunk (each run to its end before the next is submitted: what ``jaxformer generate`` does for one prompt,
    minus its process start and compilation), and all submitted at once at the server's ``chunk_size`` (the
    engine's own ceiling). Returns
    ``{engine: {"sequential" | "engine": (output tokens/s, seconds), "profile": {mode: Counter}}}``, the
    medians over the rounds (the engines take turns, each going first every other round), the profile summed
    over rounds (:func:`run_profiled`), ``"copies"`` whether the engine's step model got FFN copies."""
    from jaxformer.train.run_dir import load_hf_decoder
    from jaxformer.decode.sampling import SamplingParams
    from jaxformer.serve.server import build_engine

    config, graphdef, state, _ = load_hf_decoder(str(model), dtype="float32", command="generate")
    chunks = {"sequential": GenerateOptions.chunk_size, "engine": chunk_size}  # generate's, the server's
    engines = {(name, key): build_engine(graphdef, state, config, max_batch=max_batch, max_context=max_context,
                                         chunk_size=chunks[key], feature_major=fm)
               for name, fm in (("default", None), ("feature_major=False", False)) for key in chunks}
    for engine in engines.values():
        engine.compile_all()
    names = ("default", "feature_major=False")
    out = {name: {"profile": {"one after another": collections.Counter(), "all at once": collections.Counter()},
                  "sequential": [], "engine": []} for name in names}
    total = sum(n for _, n in requests)
    for r in range(repeats):
        for key, mode in (("sequential", "one after another"), ("engine", "all at once")):
            turns = [(name, engines[name, key]) for name in names]
            for name, engine in turns if r % 2 == 0 else turns[::-1]:  # in turns, each first every other round
                profile = out[name]["profile"][mode]
                t0 = time.perf_counter()
                for i, (p, n) in enumerate(requests):
                    engine.submit(p, SamplingParams(max_new_tokens=n), request_id=(r, key, i))
                    if key == "sequential":
                        run_profiled(engine, profile)
                run_profiled(engine, profile)
                wall = time.perf_counter() - t0
                tokens = sum(len(engine.results.pop((r, key, i)).tokens) for i in range(len(requests)))
                assert tokens == total
                out[name][key].append((tokens / wall, wall))
    for name, res in out.items():
        for key in ("sequential", "engine"):
            res[key] = tuple(statistics.median(x) for x in zip(*res[key]))  # (tokens/s, seconds), each's median
        fm = engines[name, "engine"]._feature_major  # made at the first call of 2-32 rows, if the runs had one
        res["copies"] = fm is not None and fm[0] is not engines[name, "engine"]._plain[0]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="Poisson arrival rates, req/s")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=16, help="prefill tokens per sequence per step (server and "
                    "engine): a step with a prefill chunk runs every row at its width")
    ap.add_argument("--max-context", type=int, default=256, help="the server's (prompts + outputs fit: one "
                    "block-table width, fewer shapes to compile)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the in-process runs (the median's figures)")
    ap.add_argument("--small", action="store_true", help="a 4-layer d 256 model instead of SmolLM2-135M's shape")
    ap.add_argument("--write", action="store_true", help="also write experiments/results/serve_cpu.md")
    args = ap.parse_args(argv)
    hf = SMALL if args.small else SMOLLM2_135M
    name = "small_random" if args.small else "smollm2_135m_random"
    model = checkpoint(Path(tempfile.gettempdir()) / f"jaxformer_bench_serve_{name}", hf)
    requests = sample_requests(args.requests, hf["vocab_size"], (args.min_prompt, args.max_prompt),
                               (args.min_out, args.max_out))
    cpu = cpu_line()
    print(cpu, flush=True)
    t_all = time.perf_counter()
    server = Server(model, ["--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
                            "--chunk-size", str(args.chunk_size),
                            "--max-queue", str(4 * args.requests), "--precompile"])
    try:
        t = time.perf_counter()
        run_concurrent(server.url, requests[:4], 4)  # the HTTP path once (every step shape is compiled)
        print(f"warm-up {time.perf_counter() - t:.0f} s; server: {server.started()}", flush=True)
        rows = [("1 at a time (an idle server)", summarize(*run_concurrent(server.url, requests, 1)))]
        for rate in args.rates:
            res, wall = run_poisson(server.url, requests, rate)
            rows.append((f"Poisson {rate:g} req/s", summarize(res, wall)))
            print(rows[-1][0], rows[-1][1]["tok_s"], flush=True)
        res, wall = run_concurrent(server.url, requests, args.concurrency)
        rows.append((f"{args.concurrency} concurrent", summarize(res, wall)))
        print(rows[-1][0], rows[-1][1]["tok_s"], flush=True)
    finally:
        code = server.stop()
    engines = in_process(model, requests, args.max_batch, args.max_context, args.chunk_size, args.repeats)
    alone, usual = engines["default"], engines["feature_major=False"]
    (seq_tok_s, seq_wall), (engine_tok_s, engine_wall) = alone["sequential"], alone["engine"]
    total = sum(n for _, n in requests)
    lines = [
        f"Model: random checkpoint of {'a small Llama (4 layers, d 256)' if args.small else 'SmolLM2-135M shape'}"
        f" ({hf['num_hidden_layers']} layers, d {hf['hidden_size']}, {hf['num_attention_heads']}/"
        f"{hf['num_key_value_heads']} heads, vocabulary {hf['vocab_size']:,}), fp32; server `--max-batch "
        f"{args.max_batch} --max-context {args.max_context} --chunk-size {args.chunk_size} --precompile`, greedy.",
        f"Requests: {args.requests}, prompts uniform [{args.min_prompt}, {args.max_prompt}] tokens, outputs uniform "
        f"[{args.min_out}, {args.max_out}] ({total:,} output tokens); streamed over HTTP, one connection each.",
        cpu, "",
        "| mode | req/s | output tok/s | TTFT ms mean / median / p99 | TPOT ms mean / median / p99 | "
        "ITL ms mean / median / p99 | failed |",
        "|---|---|---|---|---|---|---|"]
    for label, s in rows:
        lines.append(f"| {label} | {s['req_s']:.2f} | {s['tok_s']:.1f} | {stats(s['ttft'])} | {stats(s['tpot'])} | "
                     f"{stats(s['itl'])} | {s['failed']} of {s['requests']} |")
    lines.append("| no server: one after another (`generate`'s engine, prefill chunks of "
                 f"{GenerateOptions.chunk_size}) "
                 f"| {args.requests / seq_wall:.2f} | {seq_tok_s:.1f} | | | | 0 of {args.requests} |")
    lines.append(f"| the engine alone, all {args.requests} submitted at once (no HTTP) | "
                 f"{args.requests / engine_wall:.2f} | {engine_tok_s:.1f} | | | | |")
    for label, (tok_s, wall) in (("one after another", usual["sequential"]), ("all at once", usual["engine"])):
        lines.append(f"| the engine without feature-major steps (`feature_major=False`), {label} | "
                     f"{args.requests / wall:.2f} | {tok_s:.1f} | | | | |")
    conc, idle, lowest = rows[-1][1], rows[0][1], rows[1][1]
    p99_low, p99_idle = (p99(s["ttft"]) for s in (lowest, idle))
    lines += ["", f"{args.concurrency} concurrent vs one after another: {conc['tok_s'] / seq_tok_s:.1f}x output "
              f"tokens/s (goal >= 4x); {100 * conc['tok_s'] / engine_tok_s:.0f}% of the engine alone (goal >= 80%). "
              f"p99 TTFT at the lowest rate {args.rates[0]:g} req/s: {1e3 * p99_low:.0f} ms = "
              f"{p99_low / p99_idle:.1f}x the same requests' on an idle server (goal <= 2x). Failed or lost requests: "
              f"{sum(s['failed'] for _, s in rows)} (goal 0); server exit code after SIGTERM: {code}.",
              (f"Feature-major steps (the CPU default) against the engine without them: all at once "
               f"{engine_tok_s / usual['engine'][0]:.2f}x, one after another {seq_tok_s / usual['sequential'][0]:.2f}x "
               "the output tokens/s." if alone["copies"] else "The default engine gave no FFN copies (the model's "
               "FFNs are below FEATURE_MAJOR_MIN_WEIGHTS): its rows and the feature_major=False ones are one engine."),
              "What bounds the first ratio (a ceiling, not a goal): if every batched decode step cost no more than "
              "a one-row step, the all-at-once run would be {:.1f}x the one-after-another one with this run's "
              "schedule; prefill, about the same work either way, is the rest.".format(
                  ceiling(alone["profile"]["one after another"], alone["profile"]["all at once"], seq_wall,
                          args.repeats)),
              f"Whole run {time.perf_counter() - t_all:.0f} s.", "",
              f"Where the engines' time went without HTTP ({args.repeats} rounds summed, the two engines taking turns; "
              "every `Engine.step` timed; a step's "
              "kind: all its rows decoding, at B batch rows, or holding a prefill chunk):", "",
              *profile_lines({**alone["profile"], **{f"{k}, feature_major=False": v
                                                     for k, v in usual["profile"].items()}})]
    errors = [e for _, s in rows for e in s["errors"]]
    if errors:
        lines.append(f"Errors: {errors}")
    table = "\n".join(lines)
    print("\n" + table)
    if args.write:
        command = shlex.join(["python", "experiments/bench/serve.py", *(argv if argv is not None else sys.argv[1:])])
        out = ROOT / "experiments" / "results" / "serve_cpu.md"
        out.write_text(f"# Serving benchmark (cpu)\n\nCommand: `{command}`\n\n{table}\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
