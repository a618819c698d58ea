"""Compile every Pallas GPU kernel for real GPUs without one: shared memory, registers, spills.

Interpret mode proves the kernels' math, not that Triton compiles them well. This script lowers
each kernel through ``jax.export(..., platforms=["cuda"])`` (no GPU needed), captures the Triton IR
that JAX hands to XLA, and compiles it with the ``triton`` package and its bundled ``ptxas`` to a
cubin for sm_90a (H100/H200), sm_80 (A100) and sm_86 (RTX 30/40, A10, L4: 99 KiB shared), reading
off per kernel: shared memory per block, registers per thread, spill bytes. A kernel is **ok** when
it spills nothing and fits the architecture's shared memory per block (sm_90a 227 KiB, sm_80 163 KiB,
sm_86 99 KiB).

The matrix: flash attention forward, dq and dk/dv in three variants (``dense``: causal;
``full``: causal + segment ids + kv lengths + ALiBi + softcap, the most registers;
``sparse``: a block map with global rows/columns and random blocks under a window) and paged
decode (``paged``: ALiBi + softcap + window, page sizes 16 and 64), for head dims 64/128/256 and
fp32/bf16, at the block sizes, warps and stages of ``pallas_kernels/block_table.py`` (what the
dispatcher uses on that architecture).

Two interpreters: this one (the project's venv: jax, pallas_kernels) lowers and captures; the
compile runs in subprocesses of an interpreter that has ``triton`` (``pip install -e '.[gpu-compile]'``
puts the pinned one in the project's venv; ``--triton-python`` or ``$JAXFORMER_TRITON_PYTHON``
names another). The Triton in pip is not the one inside jaxlib: a close proxy, not the truth.
PTX is assembled by the newest ptxas triton bundles (CUDA 13.x), the one XLA would use on the
CUDA 13 GPU machines. Results are cached by IR, arch, warps, stages and triton version
(``--cache``; triton keeps its own cache of compiled IR too).

    python experiments/bench/gpu_compile.py                      # the matrix -> experiments/results/gpu_compile.md
    python experiments/bench/gpu_compile.py --arch 90 --hd 128 --dtype bf16 --kernel fwd,dkv --out ''
    python experiments/bench/gpu_compile.py --search             # pick spill-free configs, rewrite the table

``--search`` walks :func:`candidates` per (arch, head dim, dtype, kernel) in the order they look
fastest (largest tile first; see there) at 2 pipeline stages, compiling each first in the variant
most likely to spill (``full``) and only then in the others, and keeps the first candidate ok in
every variant; then it tries 3 stages on each winner and keeps them where every variant stays ok.
The table module is rewritten between its GENERATED markers (``--no-write``: only report). The
full search took 33 minutes on 2 busy cores (~600 compiles) for sm_90a + sm_80; dk/dv alone 11 minutes
(~200) on idle ones; sm_86 alone 9 minutes on idle ones.

The capture patches private JAX functions (the Pallas Triton lowering and ``mlir.custom_call``)
of jaxlib <= 0.10.2, where the Triton IR reaches XLA as a custom call; newer JAX compiles it in
jaxlib and needs a touch here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
ARCHS = (90, 80, 86)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "f32")
FLASH_KERNELS = ("fwd", "dq", "dkv")
KERNELS = FLASH_KERNELS + ("paged",)
FLASH_VARIANTS = ("dense", "full", "sparse")
PAGE_SIZES = (16, 64)
# The triton release the committed verdicts (experiments/results/gpu_compile.md, the block table) were compiled
# with; pyproject's test and gpu-compile extras pin it. Another release spills elsewhere (3.8.0, torch 2.14.1's:
# dq at sm_86, hd 128, bf16, 128x64 blocks spills 3,852 bytes that 3.9.0 does not).
PINNED_TRITON = "3.9.0"
KERNEL_NAMES = {"flash_attention_fwd": "fwd", "flash_attention_dq": "dq", "flash_attention_dkv": "dkv",
                "paged_attention_gpu": "paged"}


def family(arch: int) -> str:
    return f"sm{arch}"


# --------------------------------------------------------------------------- compile worker (triton venv)
# Runs as `python gpu_compile.py --compile-worker JOBS.json` in an interpreter with `triton`;
# imports nothing of the project and no jax.


def compile_worker(jobs_path: str) -> None:
    """Compile each job ``{path, arch, warps, stages}``; print one JSON result per line."""
    import glob

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The newest bundled assembler ("ptxas-blackwell", CUDA 13.x in triton 3.9) for every arch: XLA assembles
    # Triton's PTX with the CUDA toolkit's ptxas (CUDA 13 on the GPU machines), not with triton's choice.
    ptxas = max(glob.glob(os.path.join(bindir, "ptxas*")))
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=False).stdout
    release = re.search(r"release ([\d.]+)", version)
    with open(jobs_path) as f:
        jobs = json.load(f)
    progress = open(jobs_path + ".results", "a")  # noqa: SIM115 - one line per result, for a watching eye
    for job in jobs:
        arch = job["arch"]
        res = dict(job, triton=triton.__version__, ptxas=release.group(1) if release else "?")
        t0 = time.perf_counter()
        try:
            k = triton.compile(job["path"], target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": job["warps"], "num_stages": job["stages"]})
            with tempfile.TemporaryDirectory() as tmp:
                ptx = os.path.join(tmp, "k.ptx")
                with open(ptx, "w") as fh:
                    fh.write(k.asm["ptx"])
                name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
                out = subprocess.run([ptxas, "-v", "--gpu-name", name, ptx, "-o", ptx + ".cubin"],
                                     capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"ptxas: {out.stderr.strip()[:300]}")
            regs = re.search(r"Used (\d+) registers", out.stderr)
            st = re.search(r"(\d+) bytes spill stores", out.stderr)
            ld = re.search(r"(\d+) bytes spill loads", out.stderr)
            res.update(shared=int(k.metadata.shared), regs=int(regs.group(1)) if regs else -1,
                       spill_st=int(st.group(1)) if st else 0, spill_ld=int(ld.group(1)) if ld else 0)
        except Exception as e:  # noqa: BLE001 - report and go on
            res["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        res["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(res), flush=True)
        progress.write(json.dumps(res) + "\n")
        progress.flush()


# --------------------------------------------------------------------------- capture (project venv)


@contextlib.contextmanager
def capture_ttir(out_dir: str):
    """Write the Triton IR of every Pallas GPU kernel lowered inside the block to ``out_dir``.

    Yields a list that fills with ``(path, kernel name, num_warps, num_stages)``.
    """
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as registration

    os.makedirs(out_dir, exist_ok=True)
    files, pending = [], []
    original_lower, original_call = lowering.lower_jaxpr_to_triton_module, mlir.custom_call

    def lower(*args, **kwargs):
        result = original_lower(*args, **kwargs)
        pending.append(str(result.module.operation))
        return result

    def custom_call(call_target_name, *args, **kwargs):
        config = kwargs.get("backend_config")
        if call_target_name == "__gpu$xla.gpu.triton" and pending and isinstance(config, dict):
            text = pending.pop()
            warps, stages = (ir.IntegerAttr(config[k]).value for k in ("num_warps", "num_stages"))
            name = ir.StringAttr(config["name"]).value
            path = os.path.join(out_dir, f"{name}.{len(os.listdir(out_dir))}.w{warps}s{stages}.ttir")
            with open(path, "w") as f:
                f.write(text)
            files.append((path, name, warps, stages))
        return original_call(call_target_name, *args, **kwargs)

    lowering.lower_jaxpr_to_triton_module = registration.lowering.lower_jaxpr_to_triton_module = lower
    mlir.custom_call = custom_call
    try:
        yield files
    finally:
        lowering.lower_jaxpr_to_triton_module = registration.lowering.lower_jaxpr_to_triton_module = original_lower
        mlir.custom_call = original_call


def _export(fn, *avals):
    import jax

    jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)


def _flash_case(variant: str, hd: int, dtype: str):
    """(function of q, k, v, avals) whose gradient lowers the three flash kernels in ``variant``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import flash_attention

    B, T, N, K = 1, 1024, 4, 2
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    kw: dict = dict(backend="gpu", causal=True)
    if variant == "full":
        seg = jnp.asarray(np.repeat(np.arange(4), T // 4)[None], jnp.int32)
        kw.update(q_segment_ids=seg, kv_segment_ids=seg, kv_lengths=jnp.full((B,), T - 3, jnp.int32),
                  alibi_slopes=jnp.linspace(0.1, 1.0, N), softcap=30.0)
    elif variant == "sparse":
        rng = np.random.default_rng(0)

        def block_map(bq, bk):
            nq, nk = -(-T // bq), -(-T // bk)
            return np.ones((1, nq, nk), bool)  # every tile listed: the kernels' worst case

        q_glob = np.zeros((1, T), np.int32)
        q_glob[:, :16] = 1
        kv_glob = np.zeros((1, T), np.int32)
        kv_glob[:, :16] = 1
        starts = rng.integers(0, T - 32, size=(1, 2, T)).astype(np.int32)
        kw.update(causal=False, window=(64, 64), block_map=block_map, q_global=q_glob, kv_global=kv_glob,
                  random_kv_starts=starts, random_block_size=32)
    elif variant != "dense":
        raise ValueError(variant)

    def loss(q, k, v):
        return flash_attention(q, k, v, **kw).astype(jnp.float32).sum()

    def fn(q, k, v):
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    avals = [jax.ShapeDtypeStruct((B, T, N, hd), dt), jax.ShapeDtypeStruct((B, T, K, hd), dt),
             jax.ShapeDtypeStruct((B, T, K, hd), dt)]
    return fn, avals


def _paged_case(page_size: int, hd: int, dtype: str):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention

    B, N, K, M = 4, 16, 4, 32
    P = B * M
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32

    def fn(q, kp, vp, tables, lengths):
        return paged_attention(q, kp, vp, tables, lengths, alibi_slopes=jnp.linspace(0.1, 1.0, N), softcap=30.0,
                               window=page_size * M // 2, backend="gpu")

    avals = [jax.ShapeDtypeStruct((B, N, hd), dt), jax.ShapeDtypeStruct((K, P, page_size, hd), dt),
             jax.ShapeDtypeStruct((K, P, page_size, hd), dt), jax.ShapeDtypeStruct((B, M), jnp.int32),
             jax.ShapeDtypeStruct((B,), jnp.int32)]
    return fn, avals


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (arch, head dim, dtype) point; ``configs`` overrides table entries: kernel -> KernelConfig."""

    arch: int
    hd: int
    dtype: str
    configs: tuple = ()  # ((kernel, KernelConfig), ...)


def capture_cell(cell: Cell, out_dir: str, kernels=KERNELS, variants=FLASH_VARIANTS) -> list[dict]:
    """Lower the cell's kernels under its arch's table (and overrides); one job dict per captured kernel."""
    import jax

    from pallas_kernels import block_table

    overrides = {(family(cell.arch), cell.hd, cell.dtype, k): c for k, c in cell.configs}
    jobs = []
    jax.clear_caches()  # jitted kernels (paged) read the table when traced
    with block_table.target_arch(family(cell.arch)), block_table.overriding(overrides):
        cases = []
        if any(k in FLASH_KERNELS for k in kernels):
            cases += [(v, _flash_case(v, cell.hd, cell.dtype)) for v in variants]
        if "paged" in kernels:
            cases += [(f"L{L}", _paged_case(L, cell.hd, cell.dtype)) for L in PAGE_SIZES]
        for variant, (fn, avals) in cases:
            with capture_ttir(out_dir) as files:
                _export(fn, *avals)
            for path, name, warps, stages in files:
                kernel = KERNEL_NAMES.get(name, name)
                if kernel not in kernels:
                    continue
                cfg = block_table.lookup(kernel, cell.hd, cell.dtype, arch=family(cell.arch))
                jobs.append(dict(path=path, arch=cell.arch, hd=cell.hd, dtype=cell.dtype, kernel=kernel,
                                 variant=variant, warps=warps, stages=stages,
                                 block_q=cfg.block_q, block_k=cfg.block_k))
    return jobs


# --------------------------------------------------------------------------- driving the compile


def triton_python(explicit: str | None = None) -> str | None:
    """An interpreter that can ``import triton``: ``explicit``, ``$JAXFORMER_TRITON_PYTHON``, or this one."""
    for cand in (explicit, os.environ.get("JAXFORMER_TRITON_PYTHON")):
        if cand:
            return cand
    import importlib.util

    return sys.executable if importlib.util.find_spec("triton") is not None else None


def triton_version(python: str) -> str:
    """``triton.__version__`` in interpreter ``python`` ('' where it cannot import triton or does not run)."""
    try:
        return subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                              text=True, check=False).stdout.strip()
    except OSError:
        return ""


def _job_key(job: dict, salt: str) -> str:
    import hashlib

    with open(job["path"], "rb") as f:
        text = f.read()
    return hashlib.sha256(text + f"|{job['arch']}|{job['warps']}|{job['stages']}|{salt}".encode()).hexdigest()


RESULT_FIELDS = ("shared", "regs", "spill_st", "spill_ld", "error", "triton", "ptxas", "seconds")


def compile_jobs(jobs: list[dict], python: str, workers: int = 2, cache: str | None = None,
                 salt: str = "") -> list[dict]:
    """Compile ``jobs`` in ``workers`` subprocesses of ``python``; results in job order.

    ``cache``: a JSON-lines file of earlier results keyed by the IR, arch, warps, stages and ``salt``
    (the triton version): hits are not compiled again, new results are appended.
    """
    if not jobs:
        return []
    done, keys = {}, [_job_key(j, salt) for j in jobs]
    if cache and os.path.exists(cache):
        with open(cache) as f:
            for line in f:
                entry = json.loads(line)
                done[entry.pop("key")] = entry
    todo = [j for j, k in zip(jobs, keys) if k not in done]
    for r in _compile_uncached(todo, python, workers):  # a job the worker died on gets no result (not cached)
        k = _job_key(r, salt)
        done[k] = {f: r[f] for f in RESULT_FIELDS if f in r}
        if cache:
            os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
            with open(cache, "a") as f:
                f.write(json.dumps(dict(done[k], key=k)) + "\n")
    return [dict(j, **done.get(k, {"error": "no result from the compile worker"})) for j, k in zip(jobs, keys)]


def _compile_uncached(jobs: list[dict], python: str, workers: int) -> list[dict]:
    """Compile in ``workers`` subprocesses (jobs dealt round-robin); their files sit beside the first job's IR."""
    if not jobs:
        return []
    workers = max(1, min(workers, len(jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    procs = []
    for chunk in chunks:
        fd, path = tempfile.mkstemp(prefix="jobs", suffix=".json", dir=os.path.dirname(chunk[0]["path"]))
        with os.fdopen(fd, "w") as f:
            json.dump(chunk, f)
        out, err = open(path + ".stdout", "w+"), open(path + ".stderr", "w+")  # noqa: SIM115
        procs.append((subprocess.Popen([python, os.path.abspath(__file__), "--compile-worker", path],
                                       stdout=out, stderr=err, text=True), out, err))
    by_path = {}
    for p, out, err in procs:
        p.wait()
        out.seek(0)
        err.seek(0)
        lines = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        if p.returncode and not lines:
            raise RuntimeError(f"compile worker ({python}) failed:\n{err.read()[-2000:]}")
        out.close()
        err.close()
        by_path.update((r["path"], r) for r in lines)
    return [by_path[j["path"]] for j in jobs if j["path"] in by_path]


def verdict(r: dict) -> str:
    if "error" in r:
        return "COMPILE FAILED"
    if r["shared"] > SHARED_LIMIT.get(r["arch"], 99 * 1024):
        return "too much shared"
    if r["spill_st"] or r["spill_ld"]:
        return "spills"
    return "ok"


def ok(r: dict) -> bool:
    return verdict(r) == "ok"


def arch_name(arch: int) -> str:
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"


def fmt_row(r: dict) -> str:
    blocks = "-" if r.get("block_q") is None else f"{r['block_q']}x{r['block_k']}"
    if "error" in r:
        tail = f"| - | - | - | COMPILE FAILED: {r['error'][:80]} |"
    else:
        tail = (f"| {r['shared'] / 1024:.1f} | {r['regs']} | {r['spill_st']}/{r['spill_ld']} | {verdict(r)} |")
    return (f"| {r['kernel']} | {r['variant']} | {arch_name(r['arch'])} | {r['hd']} | {r['dtype']} | {blocks} | "
            f"{r['warps']}/{r['stages']} {tail}")


HEADER = ("| kernel | variant | arch | hd | dtype | blocks (q x k) | warps/stages | shared KiB | regs "
          "| spill st/ld B | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|")


class Matrix(NamedTuple):
    """What to compile: architectures (``90``), head dims, dtypes (``"bf16"``) and kernel names."""
    archs: tuple
    hds: tuple
    dtypes: tuple
    kernels: tuple = KERNELS


class Compiler(NamedTuple):
    """How to compile: the interpreter with ``triton``, its worker processes, the result cache and its salt."""
    python: str
    workers: int = 2
    cache: str | None = None
    salt: str = ""

    def run(self, jobs: list[dict]) -> list[dict]:
        return compile_jobs(jobs, self.python, self.workers, self.cache, self.salt)


def run_matrix(matrix: Matrix, compiler: Compiler, work: str, variants=FLASH_VARIANTS, cells_configs=None,
               log=print) -> list[dict]:
    """Capture (here) then compile (triton interpreter) every kernel of the matrix; rows in matrix order."""
    archs, hds, dtypes, kernels = matrix
    jobs = []
    t0 = time.perf_counter()
    for arch in archs:
        for hd in hds:
            for dtype in dtypes:
                configs = (cells_configs or {}).get((arch, hd, dtype), ())
                jobs += capture_cell(Cell(arch, hd, dtype, configs), os.path.join(work, f"sm{arch}_{hd}_{dtype}"),
                                     kernels, variants)
    t1 = time.perf_counter()
    rows = compiler.run(jobs)
    log(f"# {len(jobs)} kernels: capture {t1 - t0:.1f} s, compile {time.perf_counter() - t1:.1f} s "
        f"({compiler.workers} workers)")
    return rows


# --------------------------------------------------------------------------- search


def candidates(kernel: str, hd: int, dtype: str) -> list:
    """Candidate configs of one kernel, fastest-looking first, at 2 stages (:func:`search` then tries 3).

    Flash: power-of-two tiles 16..128 within the dispatcher's tile budget (``gpu.MAX_TILE_BYTES``; fp32 up to
    64 x 64), largest area first; at equal area tiles with no side of 16 (a thin dot) first, then the long side
    where the kernel reuses a tile across its loop (q for forward and dq, k for dk/dv), then the warps that
    suit the tile (8 from 128 x 64 up, where 4 warps always spilled; at 64 x 64 and below 4 for head dim 64,
    else 8, then the other). Paged: 4 warps, then 8, then 2 (its tile is the caller's page), then 1 stage.
    """
    from pallas_kernels.block_table import KernelConfig
    from pallas_kernels.flash_attention.blocks import tile_bytes
    from pallas_kernels.flash_attention.gpu import MAX_TILE_BYTES

    if kernel == "paged":
        # 1 stage last: one page in flight, for tiles whose double buffer does not fit (fp32, head dim 256,
        # 64-token pages on a 99 KiB GPU)
        return [KernelConfig(None, None, w, 2) for w in (4, 8, 2)] + [KernelConfig(None, None, w, 1) for w in (4, 8)]
    itemsize = 2 if dtype == "bf16" else 4
    # fp32 dots are exact (IEEE), on the FMA units: no tensor core, so tiles past 64 x 64 buy no reuse, only registers
    max_area = 128 * 128 if dtype == "bf16" else 64 * 64
    out = []
    for bq in (128, 64, 32, 16):
        for bk in (128, 64, 32, 16):
            area = bq * bk
            if tile_bytes(bq, bk, hd, itemsize) > MAX_TILE_BYTES or area > max_area:
                continue
            warps = (8,) if area >= 128 * 64 else (4, 8) if hd <= 64 else (8, 4)
            out += [KernelConfig(bq, bk, w, 2) for w in warps]

    def score(c):
        lead = c.block_k if kernel == "dkv" else c.block_q
        return -c.block_q * c.block_k, min(c.block_q, c.block_k) < 32, -lead  # a 16 side: thin MMAs, last

    return sorted(out, key=score)  # stable: the warps order above breaks the remaining ties


PROBE_ORDER = ("full", "sparse", "dense")  # the variant most likely to spill first (most live values)


def search(matrix: Matrix, compiler: Compiler, work: str, log=print, batch: int = 3,
           variants=FLASH_VARIANTS) -> dict:
    """Per (arch, hd, dtype, kernel): the first candidate (:func:`candidates` order) ok in every variant,
    then with 3 pipeline stages instead of 2 where that is ok too.

    Rounds: per cell, up to ``batch`` open candidates of each unresolved kernel are compiled, a fresh one
    on the probe variant only (:data:`PROBE_ORDER`), one that passed its probe on the other variants; the
    three flash kernels of a cell share one lowering per slot. A key resolves when its first candidate that
    has not failed has passed everything; when every candidate fails, to :func:`least_spilling`'s choice
    (logged). Returns ``{(arch, hd, dtype, kernel): KernelConfig}``.
    """
    archs, hds, dtypes, kernels = matrix
    probe = [v for v in PROBE_ORDER if v in variants]
    state = {}
    for a in archs:
        for h in hds:
            for d in dtypes:
                for k in kernels:
                    vs = probe if k != "paged" else ["L"]  # paged: both page sizes in one capture
                    state[(a, h, d, k)] = [dict(cfg=c, todo=list(vs), failed=False, stage3=False)
                                           for c in candidates(k, h, d)]
    chosen = {}
    rnd = 0

    def resolve(key):
        for c in state[key]:
            if c["failed"]:
                continue
            return c if not c["todo"] else None
        return False  # every candidate failed

    while True:
        rnd += 1
        # schedule: slot -> {kernel: (candidate entry, variants)}, per cell
        plan = []
        for a in archs:
            for h in hds:
                for d in dtypes:
                    slots = [dict() for _ in range(batch)]
                    for k in kernels:
                        key = (a, h, d, k)
                        if key in chosen or state[key] is None:
                            continue
                        open_ = [c for c in state[key] if not c["failed"] and c["todo"]][:batch]
                        for slot, c in zip(slots, open_):
                            vs = c["todo"][:1] if len(c["todo"]) == len(probe) and k != "paged" else c["todo"]
                            slot[k] = (c, vs)
                    for i, slot in enumerate(slots):
                        if slot:
                            plan.append(((a, h, d), i, slot))
        if not plan:
            break
        jobs, owners = [], []
        for (a, h, d), i, slot in plan:
            configs = tuple((k, c["cfg"]) for k, (c, _) in slot.items())
            vs = sorted({v for _, want in slot.values() for v in want if v != "L"})
            ks = tuple(slot)
            cell_jobs = capture_cell(Cell(a, h, d, configs), os.path.join(work, f"r{rnd}", f"sm{a}_{h}_{d}_{i}"),
                                     ks, tuple(vs) or ("dense",))
            for j in cell_jobs:
                c, want = slot[j["kernel"]]
                if j["kernel"] == "paged" or j["variant"] in want:
                    jobs.append(j)
                    owners.append((c, j["variant"] if j["kernel"] != "paged" else "L"))
        results = compiler.run(jobs)
        for (c, v), r in zip(owners, results):
            c.setdefault("rows", []).append(r)
            if not ok(r):
                c["failed"] = True
            if v in c["todo"]:
                c["todo"].remove(v)
        for key in list(state):
            if key in chosen or state[key] is None:
                continue
            c = resolve(key)
            if c is False:
                least = least_spilling(state[key], len(PAGE_SIZES) if key[3] == "paged" else len(probe))
                state[key] = None
                if least is None:
                    log(f"  {arch_name(key[0])} hd{key[1]} {key[2]} {key[3]}: NO candidate compiled in every "
                        "variant within shared memory: no entry written")
                else:
                    chosen[key] = least["cfg"]
                    log(f"  {arch_name(key[0])} hd{key[1]} {key[2]} {key[3]}: NO spill-free candidate; the least "
                        f"spilling: {least['cfg']} ({_worst_spill(least)} B)")
            elif c is not None:
                chosen[key] = c["cfg"]
                log(f"  {arch_name(key[0])} hd{key[1]} {key[2]} {key[3]}: {c['cfg']}")
        log(f"# search round {rnd}: {len(jobs)} kernels, {len(chosen)} chosen")
    # upgrade: 3 stages where every variant still compiles ok
    up_jobs, up_owner = [], []
    cells = {}
    for (a, h, d, k), cfg in chosen.items():
        cells.setdefault((a, h, d), []).append((k, dataclasses.replace(cfg, num_stages=3)))
    for (a, h, d), configs in cells.items():
        cell_jobs = capture_cell(Cell(a, h, d, tuple(configs)), os.path.join(work, "stages3", f"sm{a}_{h}_{d}"),
                                 tuple(k for k, _ in configs), tuple(v for v in FLASH_VARIANTS if v in variants))
        up_jobs += cell_jobs
        up_owner += [(a, h, d, j["kernel"]) for j in cell_jobs]
    verdicts = {}
    for key, r in zip(up_owner, compiler.run(up_jobs)):
        verdicts[key] = verdicts.get(key, True) and ok(r)
    for key, good in verdicts.items():
        if good:
            chosen[key] = dataclasses.replace(chosen[key], num_stages=3)
            log(f"  {arch_name(key[0])} hd{key[1]} {key[2]} {key[3]}: 3 stages ok")
    return chosen


def _worst_spill(c: dict) -> int:
    return max(r["spill_st"] + r["spill_ld"] for r in c["rows"])


def least_spilling(cands: list[dict], n_variants: int) -> dict | None:
    """When no candidate is ok: among those compiled in all ``n_variants`` variants (a candidate that failed its
    probe was not compiled in the others, so its worst case is unknown), the one that fits shared memory
    everywhere with the smallest worst spill (what the table then holds, so the dispatcher still has an
    entry; the report shows the spill). None when there is no such candidate."""
    fits = [c for c in cands if len({r["variant"] for r in c.get("rows", ())}) == n_variants
            and all("error" not in r and r["shared"] <= SHARED_LIMIT.get(r["arch"], 99 * 1024) for r in c["rows"])]
    return min(fits, key=_worst_spill, default=None)


TABLE_BEGIN = "# BEGIN GENERATED TABLE"
TABLE_END = "# END GENERATED TABLE"


def write_table(chosen: dict, path: str) -> None:
    """Replace the entries of ``chosen`` in the table module (between its markers), keeping the others."""
    from pallas_kernels import block_table

    table = dict(block_table.TABLE)
    table.update({(f"sm{a}", h, d, k): c for (a, h, d, k), c in chosen.items()})
    order = {f: i for i, f in enumerate(block_table.ARCH_FAMILIES)}
    kern = {k: i for i, k in enumerate(KERNELS)}
    lines = [TABLE_BEGIN + " (experiments/bench/gpu_compile.py --search rewrites this block)", "TABLE = {"]
    for key in sorted(table, key=lambda k: (order.get(k[0], 99), k[1], k[2], kern.get(k[3], 99))):
        c = table[key]
        lines.append(f"    {key!r}: KernelConfig({c.block_q}, {c.block_k}, {c.num_warps}, {c.num_stages}),")
    lines += ["}", TABLE_END]
    with open(path) as f:
        src = f.read()
    pat = re.compile(re.escape(TABLE_BEGIN) + r".*?" + re.escape(TABLE_END), re.DOTALL)
    if not pat.search(src):
        raise RuntimeError(f"{path} has no {TABLE_BEGIN} ... {TABLE_END} block")
    with open(path, "w") as f:
        f.write(pat.sub(lambda _: "\n".join(lines), src))


# --------------------------------------------------------------------------- main


def _row_key(r: dict) -> tuple:
    return r["kernel"], r["variant"], r["arch"], r["hd"], r["dtype"]


def _short(r: dict | None) -> str:
    if r is None:
        return "-"
    blocks = "" if r.get("block_q") is None else f"{r['block_q']}x{r['block_k']} "
    what = "failed" if "error" in r else f"{r['spill_st']} B" if r["spill_st"] or r["spill_ld"] else "0"
    if "error" not in r and r["shared"] > SHARED_LIMIT.get(r["arch"], 99 * 1024):
        what += f", {r['shared'] / 1024:.0f} KiB shared (too much)"
    return f"{blocks}{r['warps']}/{r['stages']}: {what}"


def write_report(rows: list[dict], path: str, cmd: str, tv: str, baseline: list[dict] | None = None,
                 baseline_note: str = "") -> None:
    bad = [r for r in rows if not ok(r)]
    with open(path, "w") as f:
        f.write("# Pallas GPU kernels compiled offline: shared memory, registers, spills\n\n")
        ptxas = sorted({str(r.get("ptxas", "?")) for r in rows})
        f.write(f"`{cmd}`: triton {tv}, ptxas of CUDA {', '.join(ptxas)} (bundled with triton), on a CPU "
                "machine. The Triton in pip is a close proxy for the one inside jaxlib, not the truth. Blocks, warps "
                "and stages are what the dispatcher takes from `pallas_kernels/block_table.py` on that "
                "architecture. Limits: shared memory per block sm_90a 227 KiB, sm_80 163 KiB, sm_86 99 KiB; ok = no "
                "register spill and within the limit. Variants: `dense` causal; `full` causal + segment ids + kv "
                "lengths + ALiBi + softcap; `sparse` a block map listing every tile + global rows/columns + random "
                "blocks under a window; paged decode (ALiBi + softcap + window) with page sizes 16 (`L16`) and 64 "
                "(`L64`). B=1, T=S=1024, 4 query heads over 2 kv heads.\n\n"
                "The table holds the largest tiles that compiled spill-free in every variant (`--search`: "
                "`candidates()` order). Some are thin (a side of 16, or dk/dv with 32 keys per program at head dim "
                "128 on sm_90a): that trades MMA shape and re-reads of q/dO for no local-memory traffic; which "
                "side of that trade is faster is for a GPU to measure (`experiments/bench/gpu_suite.py`, part e). "
                "fp32 runs its dots exactly (IEEE, FMA units, no tensor cores), so its tiles stay small.\n\n")
        f.write(f"**{len(rows) - len(bad)} of {len(rows)} kernels ok.**\n\n")
        if baseline:
            old = {_row_key(r): r for r in baseline}
            f.write(f"## Spill stores before and after\n\n{baseline_note}\n\n"
                    "| kernel | variant | arch | hd | dtype | before: blocks warps/stages: spill | "
                    "now: blocks warps/stages: spill |\n|---|---|---|---|---|---|---|\n")
            f.writelines(f"| {r['kernel']} | {r['variant']} | {arch_name(r['arch'])} | {r['hd']} | {r['dtype']} | "
                         f"{_short(old.get(_row_key(r)))} | {_short(r)} |\n" for r in rows)
            f.write("\n## Now, in full\n\n")
        f.write(HEADER + "\n")
        f.writelines(fmt_row(r) + "\n" for r in rows)


def _csv(s: str, cast=str):
    return tuple(cast(x) for x in s.split(",") if x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile-worker", metavar="JOBS_JSON", help=argparse.SUPPRESS)
    p.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities, e.g. 90,80")
    p.add_argument("--hd", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--dtype", default=",".join(DTYPES))
    p.add_argument("--kernel", default=",".join(KERNELS))
    p.add_argument("--variant", default=",".join(FLASH_VARIANTS))
    p.add_argument("--triton-python", help="interpreter with `triton` (default $JAXFORMER_TRITON_PYTHON or this one)")
    p.add_argument("-j", "--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "gpu_compile.md"),
                   help="report path ('' for none)")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--compare", help="JSON rows of an earlier run (--json): the report shows both")
    p.add_argument("--compare-note", default="", help="what the earlier run was (a line in the report)")
    p.add_argument("--search", action="store_true", help="pick spill-free configs and rewrite the table module")
    p.add_argument("--no-write", action="store_true", help="with --search: leave the table module as it is")
    p.add_argument("--work", help="keep the captured .ttir files here (default: a temporary directory)")
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "jaxformer", "gpu_compile.jsonl"),
                   help="results of earlier compiles, keyed by IR, arch, warps, stages, triton ('' for none)")
    a = p.parse_args(argv)
    if a.compile_worker:
        compile_worker(a.compile_worker)
        return 0

    sys.path.insert(0, ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    python = triton_python(a.triton_python)
    if python is None:
        print("no interpreter with `triton`: pip install -e '.[gpu-compile]', or pass --triton-python / set "
              "JAXFORMER_TRITON_PYTHON to one", file=sys.stderr)
        return 2
    tv = triton_version(python)
    if tv != PINNED_TRITON:
        print(f"# triton {tv or '?'} in {python}, not the pinned {PINNED_TRITON} the committed results and the "
              f"block table were compiled with: spills and shared memory may differ", file=sys.stderr)
    archs, hds, dtypes = _csv(a.arch, int), _csv(a.hd, int), _csv(a.dtype)
    kernels, variants = _csv(a.kernel), _csv(a.variant)
    matrix = Matrix(tuple(archs), tuple(hds), tuple(dtypes), tuple(kernels))
    compiler = Compiler(python, a.workers, a.cache or None, tv)
    with contextlib.ExitStack() as stack:
        work = a.work or stack.enter_context(tempfile.TemporaryDirectory())
        if a.search:
            from pallas_kernels import block_table

            t0 = time.perf_counter()
            chosen = search(matrix, compiler, os.path.join(work, "search"), variants=variants)
            if not a.no_write:
                write_table(chosen, block_table.__file__)
            print(f"# search: {len(chosen)} entries {'chosen' if a.no_write else 'written to ' + block_table.__file__} "
                  f"in {time.perf_counter() - t0:.0f} s")
            cells = {}
            for (arch, hd, dtype, kernel), cfg in chosen.items():
                cells.setdefault((arch, hd, dtype), []).append((kernel, cfg))
            cells = {k: tuple(v) for k, v in cells.items()}
        else:
            cells = None
        rows = run_matrix(matrix, compiler, os.path.join(work, "matrix"), variants, cells)
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    bad = [r for r in rows if not ok(r)]
    print(f"# {len(rows) - len(bad)} of {len(rows)} kernels ok (triton {tv})")
    if a.out:
        shown, skip = [], False
        for arg in argv if argv is not None else sys.argv[1:]:  # the note is printed below the command anyway
            if skip or arg.startswith("--compare-note"):
                skip = arg == "--compare-note" and not skip
                continue
            shown.append(arg)
        cmd = shlex.join(["python", "experiments/bench/gpu_compile.py", *shown])
        baseline = None
        if a.compare:
            with open(a.compare) as f:
                baseline = json.load(f)
        write_report(rows, a.out, cmd.strip(), tv, baseline, a.compare_note)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
