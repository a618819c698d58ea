"""Compile every Pallas TPU kernel for real TPU generations on a machine without a TPU.

Interpret mode proves the kernels' math; this proves that Mosaic lowers *and libtpu compiles* them
(layout, tiling, VMEM limits), through libtpu's compile-only client: ``jax.experimental.topologies``
describes a TPU slice, the operands are placed on one of its chips, and ``jit(...).lower().compile()``
runs the real TPU compiler while the default backend stays the CPU.

Matrix: kernel x generation (v4:2x2x1, v5e:2x2, v5p:2x2x1, v6e:2x2) x dtype (fp32, bf16) x head dim
(64, 128, 256), at the kernels' default block sizes (but ``flash_blocks1024``). Kernels (each case is one jitted program; the
``fwd_bwd`` cases hold the forward, dq and dk/dv Mosaic kernels):

* ``flash_fwd``: causal self-attention, forward only;
* ``flash_fwd_bwd``: the same, forward + backward;
* ``flash_features``: forward + backward with GQA 4:1, causal + sliding window, segment ids,
  kv lengths, ALiBi, softcap and a length that is not a multiple of the block (padding);
* ``flash_sparse``: forward + backward on block lists (Longformer / BigBird: a block map with a band,
  global rows and columns, global query and key tokens and random key blocks);
* ``flash_blocks1024``: forward + backward at 1024 x 1024 tiles instead of the default 512 x 512 (the
  largest the tile budget accepts at hd 256 fp32): more VMEM than the compiler's default limit;
* ``paged``: paged-attention decode, one query head per kv head;
* ``paged_features``: paged decode with GQA 4:1, ALiBi, softcap and a sliding window.

For each compiled case the report gives the VMEM each Mosaic kernel uses (the
``used_scoped_memory_configs`` libtpu records on its custom call; the largest is in the summary) and
XLA's compiled memory analysis in HBM (arguments, outputs, temporaries).

Needs ``libtpu`` (the ``tpu-compile`` extra: ``pip install -e '.[tpu-compile]'``, or a venv with
``jax[tpu]`` at the project's JAX version and ``jaxtyping``); libtpu prints warnings about
TPU_ACCELERATOR_TYPE / worker hostnames on start: harmless.

    python experiments/bench/tpu_compile.py                      # the full matrix -> experiments/results/tpu_compile.md
    python experiments/bench/tpu_compile.py --topologies v5e:2x2 --dtypes bf16 --head-dims 128 --out -
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPUs are described, not present: CPU stays the default
# libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) on load; compiling needs no chip, so let several
# processes (pytest-xdist workers, a benchmark beside the tests) load it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
import numpy as np

TOPOLOGIES = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2")
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
HEAD_DIMS = (64, 128, 256)
VMEM_SPACE = "1"  # memory_space of VMEM in libtpu's scoped memory configs


def libtpu_available() -> bool:
    """Whether libtpu (the TPU compiler) can be imported here."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def compile_for_tpu(fn: Callable, *avals, topology: str = "v5e:2x2"):
    """``jax.jit(fn).lower(*avals).compile()`` for one chip of ``topology`` (no TPU needed)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    one = NamedSharding(Mesh(topo.devices[:1], ("x",)), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in avals]
    return jax.jit(fn).lower(*placed).compile()


# --------------------------------------------------------------------------- cases


def _aval(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _fwd_bwd(attn):
    """``(q, k, v, do) -> (o, dq, dk, dv)``: one program with the forward and both backward kernels."""
    def run(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))
    return run


def _flash_dense(dtype, H: int, *, backward: bool):
    from pallas_kernels.flash_attention.api import flash_attention_tpu

    B, T, N = 2, 2048, 4
    q = _aval((B, T, N, H), dtype)

    def attn(q, k, v):
        return flash_attention_tpu(q, k, v, causal=True)

    if not backward:
        return attn, (q, q, q)
    return _fwd_bwd(attn), (q, q, q, q)


def _flash_blocks1024(dtype, H: int):
    """Forward + backward at tiles of 1024 x 1024 (4x the default area): the kernels raise their scoped-VMEM
    limit above the compiler's 16 MiB default; on v4 (16 MiB of VMEM in all) hd 256 cannot fit."""
    from pallas_kernels.flash_attention.blocks import BlockSizes
    from pallas_kernels.flash_attention.api import flash_attention_tpu

    B, T, N = 1, 4096, 2
    q = _aval((B, T, N, H), dtype)

    def attn(q, k, v):
        return flash_attention_tpu(q, k, v, causal=True, block_sizes=BlockSizes(1024, 1024))

    return _fwd_bwd(attn), (q, q, q, q)


def _flash_features(dtype, H: int):
    from pallas_kernels.flash_attention.api import flash_attention_tpu

    B, T, N, K = 2, 2000, 8, 2  # 2000: padded up to whole blocks
    slopes = 2.0 ** -np.arange(1, N + 1, dtype=np.float32)

    def attn_with(qseg, kvseg, lens):
        def attn(q, k, v):
            return flash_attention_tpu(q, k, v, causal=True, window=(512, 0), q_segment_ids=qseg,
                                       kv_segment_ids=kvseg, kv_lengths=lens, alibi_slopes=jnp.asarray(slopes),
                                       softcap=30.0)
        return attn

    def run(q, k, v, do, qseg, kvseg, lens):
        return _fwd_bwd(attn_with(qseg, kvseg, lens))(q, k, v, do)

    q, kv = _aval((B, T, N, H), dtype), _aval((B, T, K, H), dtype)
    seg = _aval((B, T), jnp.int32)
    return run, (q, kv, kv, q, seg, seg, _aval((B,), jnp.int32))


def _bigbird_map(T: int, S: int, seed: int = 0):
    """Static block map ``(bq, bk) -> bool [1, nq, nk]``: band of 1, first row and column, 2 random blocks a row."""
    def block_map(bq, bk):
        nq, nk = -(-T // bq), -(-S // bk)
        i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
        live = (np.abs(i * bq - j * bk) <= max(bq, bk)) | (i == 0) | (j == 0)
        rng = np.random.default_rng(seed)
        live |= rng.random((nq, nk)) < 2.0 / nk
        return live[None]
    return block_map


_BIGBIRD_MAPS: dict = {}  # one static callable per shape, so the kernels' caches see one map


def _flash_sparse(dtype, H: int):
    from pallas_kernels.flash_attention.api import flash_attention_tpu

    B, T, N, K, n_rand, R = 2, 4096, 4, 2, 2, 64
    block_map = _BIGBIRD_MAPS.setdefault(T, _bigbird_map(T, T))

    def run(q, k, v, do, q_global, kv_global, rand):
        def attn(q, k, v):
            return flash_attention_tpu(q, k, v, window=(256, 256), block_map=block_map, q_global=q_global,
                                       kv_global=kv_global, random_kv_starts=rand, random_block_size=R)
        return _fwd_bwd(attn)(q, k, v, do)

    q, kv = _aval((B, T, N, H), dtype), _aval((B, T, K, H), dtype)
    return run, (q, kv, kv, q, _aval((B, T), jnp.int32), _aval((B, T), jnp.int32),
                 _aval((N, n_rand, T), jnp.int32))


def _paged(dtype, H: int, *, features: bool):
    from pallas_kernels.paged_attention import paged_attention

    B, K, L, M, P = 8, 4, 16, 64, 4096  # page size 16, up to 1024 tokens a sequence, a pool of 64k tokens
    N = 4 * K if features else K
    slopes = 2.0 ** -np.arange(1, N + 1, dtype=np.float32)
    kw = {"alibi_slopes": jnp.asarray(slopes), "softcap": 30.0, "window": 300} if features else {}

    def run(q, k_pages, v_pages, tables, lengths):
        return paged_attention(q, k_pages, v_pages, tables, lengths, backend="tpu", **kw)

    pages = _aval((K, P, L, H), dtype)
    return run, (_aval((B, N, H), dtype), pages, pages, _aval((B, M), jnp.int32), _aval((B,), jnp.int32))


KERNELS: dict[str, Callable] = {
    "flash_fwd": lambda dtype, H: _flash_dense(dtype, H, backward=False),
    "flash_fwd_bwd": lambda dtype, H: _flash_dense(dtype, H, backward=True),
    "flash_features": _flash_features,
    "flash_sparse": _flash_sparse,
    "flash_blocks1024": _flash_blocks1024,
    "paged": lambda dtype, H: _paged(dtype, H, features=False),
    "paged_features": lambda dtype, H: _paged(dtype, H, features=True),
}


# --------------------------------------------------------------------------- one compile


@dataclasses.dataclass
class Result:
    kernel: str
    topology: str
    dtype: str
    head_dim: int
    ok: bool
    seconds: float
    error: str = ""
    vmem: dict[str, int] = dataclasses.field(default_factory=dict)  # Mosaic kernel name -> VMEM bytes
    hbm: dict[str, int] = dataclasses.field(default_factory=dict)  # argument / output / temp bytes

    @property
    def gen(self) -> str:
        return self.topology.split(":")[0]

    @property
    def max_vmem(self) -> int:
        return max(self.vmem.values(), default=0)


_CALL_RE = re.compile(r"%([\w.\-]+) = .*?custom_call_target=\"tpu_custom_call\".*")


def mosaic_vmem(hlo_text: str) -> dict[str, int]:
    """VMEM bytes of each Mosaic kernel in a compiled module (its ``used_scoped_memory_configs``)."""
    out: dict[str, int] = {}
    for m in _CALL_RE.finditer(hlo_text):
        line = m.group(0)
        # "flash_dq_tpu.3", or under AD "transpose_jvp_flash_dq_tpu__.1": the pallas_call's name
        name = re.sub(r"^(?:(?:transpose|jvp|vmap)_)+", "", re.sub(r"\.\d+$", "", m.group(1))).rstrip("_")
        used = re.search(r'"used_scoped_memory_configs":(\[.*?\])', line)
        if not used:
            continue
        vmem = sum(int(c.get("size", 0)) for c in json.loads(used.group(1))
                   if str(c.get("memory_space")) == VMEM_SPACE)
        out[name] = max(out.get(name, 0), vmem)
    return out


def _error_line(exc: BaseException) -> str:
    """The most telling line of a compile error (Mosaic's own message when there is one)."""
    text = f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln.lower() and "traceback" not in ln.lower():
            return ln[:300]
    return lines[0][:300] if lines else type(exc).__name__


def compile_case(kernel: str, topology: str, dtype: str, head_dim: int) -> Result:
    t0 = time.perf_counter()
    try:
        fn, avals = KERNELS[kernel](DTYPES[dtype], head_dim)
        compiled = compile_for_tpu(fn, *avals, topology=topology)
    except Exception as exc:  # noqa: BLE001 -- a failed compile is a result
        res = Result(kernel, topology, dtype, head_dim, False, time.perf_counter() - t0, _error_line(exc))
        res.traceback = traceback.format_exc()  # type: ignore[attr-defined]
        return res
    res = Result(kernel, topology, dtype, head_dim, True, time.perf_counter() - t0)
    res.vmem = mosaic_vmem(compiled.as_text())
    mem = compiled.memory_analysis()
    if mem is not None:
        res.hbm = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
                   "temp": mem.temp_size_in_bytes}
    return res


# --------------------------------------------------------------------------- report


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


FINDINGS = """\
## What compiling found, and what changed

* Before the fixes: 96 / 144 of the default-block cases compiled (issue 16);
  every paged decode case failed with `ValueError: Unsupported TPU device kind: cpu`. Its page index map
  computed `(length + L - 1) // L`: `jnp.floor_divide` on ints lowers through `sign`, whose Mosaic rule asks
  the *default* device for its TPU generation (a CPU here, so no ahead-of-time compile and no
  `jax.export(..., platforms=["tpu"])` from a CPU host). It now uses `lax.div` on non-negative operands.
  All flash kernels (forward, dq, dk/dv, block-sparse lists) already compiled at their default tiles.
* Tiles above the defaults: at 1024 x 1024, fp32, hd 256, the kernels need more than the compiler's default
  16 MiB of scoped VMEM; v5p failed (`CompileTimeScopedVmemOom`). The flash kernels now ask for a larger
  scoped-VMEM limit (up to 64 MiB) when an upper estimate of their need exceeds 16 MiB, and only then, so
  the default tiles compile exactly as before (same VMEM, above).
* Impossible: 1024 x 1024 tiles at hd 256 on v4, which has 16 MiB of VMEM in all (17.3 / 17.8 MiB needed,
  fp32 / bf16). Use the default 512 tiles there.
"""


def report(results: list[Result], *, meta: str) -> str:
    topos = list(dict.fromkeys(r.topology for r in results))
    cases = list(dict.fromkeys((r.kernel, r.dtype, r.head_dim) for r in results))
    by = {(r.kernel, r.dtype, r.head_dim, r.topology): r for r in results}
    n_ok = sum(r.ok for r in results)
    lines = [
        "# Pallas TPU kernels compiled ahead of time for real TPU generations",
        "",
        meta,
        "",
        (f"**{n_ok} / {len(results)} compile.** Cells: `ok` and the largest VMEM any Mosaic kernel of the case "
         "uses (libtpu's scoped-memory record on the custom call: pipeline buffers and scratch; operands that XLA "
         "itself keeps in VMEM, small arrays on some generations, are not in it), or the error."),
        "",
        "| kernel | dtype | hd | " + " | ".join(t.split(":")[0] for t in topos) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in topos) + " |",
    ]
    errors: dict[str, list[str]] = {}
    for kernel, dtype, hd in cases:
        cells = []
        for t in topos:
            r = by.get((kernel, dtype, hd, t))
            if r is None:
                cells.append("-")
            elif r.ok:
                cells.append(f"ok {_size(r.max_vmem)}")
            else:
                key = r.error
                errors.setdefault(key, []).append(f"{kernel}/{dtype}/hd{hd}/{r.gen}")
                cells.append(f"error [{list(errors).index(key) + 1}]")
        lines.append(f"| {kernel} | {dtype} | {hd} | " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "## Errors", ""]
        for i, (msg, where) in enumerate(errors.items(), 1):
            lines.append(f"{i}. `{msg}` ({len(where)} case{'s' * (len(where) > 1)}: {', '.join(where[:4])}"
                         f"{', ...' * (len(where) > 4)})")
    lines += ["", FINDINGS.rstrip()]
    lines += [
        "",
        "## Per case: VMEM of each Mosaic kernel (KiB), HBM of the compiled program (MiB)",
        "",
        "| kernel | gen | dtype | hd | compile s | VMEM per kernel | HBM args | HBM out | HBM temp |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.kernel} | {r.gen} | {r.dtype} | {r.head_dim} | {r.seconds:.1f} | error | | | |")
            continue
        vm = ", ".join(f"{k.removesuffix('_tpu')} {v / 2**10:.0f}" for k, v in sorted(r.vmem.items()))
        lines.append(f"| {r.kernel} | {r.gen} | {r.dtype} | {r.head_dim} | {r.seconds:.1f} | {vm} | "
                     f"{_mib(r.hbm.get('argument', 0))} | {_mib(r.hbm.get('output', 0))} | "
                     f"{_mib(r.hbm.get('temp', 0))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated, from: " + ", ".join(KERNELS))
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--out", default=str(ROOT / "experiments/results/tpu_compile.md"),
                    help="markdown report path ('-': print only)")
    ap.add_argument("--tracebacks", action="store_true", help="print the full traceback of each failure")
    args = ap.parse_args(argv)
    if not libtpu_available():
        print("libtpu is not installed: pip install -e '.[tpu-compile]' (or jax[tpu] at the project's JAX version)",
              file=sys.stderr)
        return 2
    kernels = args.kernels.split(",")
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        ap.error(f"unknown kernels {unknown}")
    results = []
    t_all = time.perf_counter()
    for kernel in kernels:
        for dtype in args.dtypes.split(","):
            for hd in map(int, args.head_dims.split(",")):
                for topo in args.topologies.split(","):
                    r = compile_case(kernel, topo, dtype, hd)
                    results.append(r)
                    status = f"ok  VMEM {_size(r.max_vmem)}" if r.ok else f"ERROR {r.error}"
                    print(f"{kernel:15s} {r.gen:4s} {dtype} hd{hd:<4d} {r.seconds:6.1f}s  {status}", flush=True)
                    if not r.ok and args.tracebacks:
                        print(r.traceback, flush=True)  # type: ignore[attr-defined]
    import libtpu  # noqa: F401

    version = getattr(sys.modules["libtpu"], "__version__", "?")
    meta = (f"jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, "
            f"libtpu {version}; compiled on a CPU-only machine in {time.perf_counter() - t_all:.0f} s "
            "(`python experiments/bench/tpu_compile.py`). Topologies: " + ", ".join(args.topologies.split(",")) +
            ". Default block sizes (`BlockSizes.default('tpu')`, clipped to the lengths) but for `flash_blocks1024`.")
    text = report(results, meta=meta)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
