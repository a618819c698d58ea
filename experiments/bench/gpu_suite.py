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

Each part is one module of ``experiments/bench/gpu_parts/`` (``correctness``, ``attention_speed``,
``paged_decode``, ``train_step``, ``block_sweep``; ``common`` holds the reporting and timing they share); this
file is the driver.

Output: one markdown file (``--out DIR`` gives ``DIR/gpu_suite.md``; a dry run writes
``gpu_suite_dryrun.md``, by default in the temp directory). Rows are appended as they are
measured, so a killed part still leaves what it had finished; a rerun appends a new run section.
The first line of each run is a header: device, JAX version, Python, date.

Runs from the source tree (the repository root goes on ``sys.path``) on any JAX >= 0.10.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Each part is a module of gpu_parts/, imported only by the part's own subprocess (this one never imports jax).
from gpu_parts.common import BOXES, DRY_BOXES, HEADER_TAG, PARTS, STATUS_TAG, TITLES, Part  # noqa: E402

MODULES = {"a": "correctness", "b": "attention_speed", "c": "paged_decode", "d": "train_step", "e": "block_sweep"}

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
    module = importlib.import_module(f"gpu_parts.{MODULES[args.worker]}")
    getattr(module, f"part_{args.worker}")(part)
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
                                "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false").strip()
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
