"""Every Pallas GPU kernel at its block-table configuration compiles for real GPUs without spilling.

The cases are those of ``experiments/bench/gpu_compile.py``: flash forward, dq and dk/dv (dense
causal; all mask features; block-sparse lists) and paged decode, lowered for CUDA on this CPU
machine (``jax.export``), their Triton IR compiled by ``triton`` + its ``ptxas`` for sm_90a, sm_80
and sm_86. A kernel passes with no register spill and shared memory within the architecture's limit.

* Without ``triton`` (the test extra leaves it out; or not Linux) only the table and the dispatcher are
  checked: the table is complete and valid, and the kernels lower with the table's warps and stages.
* With it (``pip install -e '.[test,gpu-compile]'`` installs it, or
  ``$JAXFORMER_TRITON_PYTHON`` naming an interpreter that has it), at the pinned release
  (``gc.PINNED_TRITON``; another skips, naming the one it found), the ``slow`` checks compile the hd 128 bf16
  kernels (11 per architecture: every variant) for sm_90a, sm_80 and sm_86 (12-40 s on 2 cores) and the whole
  matrix (head dims 64/128/256, fp32/bf16: 198 kernels, 6.5 min on 2 busy cores).
"""

import functools

import jax.numpy as jnp
import pytest
from packaging.requirements import Requirement

from pallas_kernels import block_table
from pallas_kernels.flash_attention.blocks import check_block_sizes
from pallas_kernels.flash_attention.gpu import (
    MAX_TILE_BYTES,
    MIN_BLOCK,
    table_block_sizes,
)
from tests.bench_scripts import load_bench

gc = load_bench("gpu_compile")

@functools.cache
def _triton() -> tuple[str | None, str]:
    python = gc.triton_python()
    return python, gc.triton_version(python) if python else ""


@pytest.fixture
def triton_python() -> str:
    """An interpreter with the pinned triton, looked up when a compile test runs (they are all slow-marked). The
    verdicts (no spill, shared memory within the limit) are the pinned release's: another spills elsewhere (triton
    3.8.0, torch 2.14.1's, spills in dq at sm_86 hd 128 bf16), so it skips, saying which it found."""
    python, version = _triton()
    if version != gc.PINNED_TRITON:
        pytest.skip(f"needs triton {gc.PINNED_TRITON} (pip install -e '.[gpu-compile]' or set "
                    f"JAXFORMER_TRITON_PYTHON); found {version or 'none'} in {python}")
    return python


# --------------------------------------------------------------------------- the table (no triton)


def test_table_is_complete_and_valid():
    for fam in block_table.ARCH_FAMILIES:
        for hd in block_table.HEAD_DIMS:
            for dtype, itemsize in (("bf16", 2), ("f32", 4)):
                for kernel in block_table.KERNELS:
                    c = block_table.TABLE[(fam, hd, dtype, kernel)]
                    assert c.num_warps in (1, 2, 4, 8, 16) and c.num_stages >= 1, c
                bs = table_block_sizes(hd, dtype, fam)
                check_block_sizes(bs, minimum=MIN_BLOCK, H=hd, itemsize=itemsize,
                                         max_tile_bytes=MAX_TILE_BYTES)


@pytest.mark.parametrize("arch, family", [("9.0", "sm90"), ("sm_90a", "sm90"), ("10.0", "sm90"), ("8.0", "sm80"),
                                          ("sm_80", "sm80"), ("8.7", "sm80"), (80, "sm80"), ((9, 0), "sm90"),
                                          ("8.6", "sm86"), ("8.9", "sm86"), ("sm_120", "sm86"), ("12.0", "sm86"),
                                          ("11.0", "sm90"), ("7.5", "sm86"), ("gfx90a", "sm86")])
def test_arch_family(arch, family):
    assert block_table.arch_family(arch) == family


def test_lookup_defaults_to_sm90_without_a_gpu(monkeypatch):
    monkeypatch.delenv(block_table.ENV_ARCH, raising=False)
    assert block_table.gpu_arch() == "sm90"
    assert block_table.lookup("fwd", 32, jnp.float16) == block_table.TABLE[("sm90", 64, "bf16", "fwd")]
    monkeypatch.setenv(block_table.ENV_ARCH, "8.0")
    assert block_table.gpu_arch() == "sm80"
    with block_table.target_arch("sm90"):
        assert block_table.gpu_arch() == "sm90"
    assert block_table.lookup("dkv", 256, jnp.float32) == block_table.TABLE[("sm80", 256, "f32", "dkv")]


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_lower_with_the_table_config(arch, tmp_path):
    """The dispatchers launch each kernel with its table entry's warps and stages (lowering only)."""
    jobs = gc.capture_cell(gc.Cell(arch, 128, "bf16"), str(tmp_path), variants=("dense",))
    assert sorted(j["kernel"] for j in jobs) == sorted(["fwd", "dq", "dkv", "paged", "paged"])
    for j in jobs:
        c = block_table.lookup(j["kernel"], 128, "bf16", arch=f"sm{arch}")
        assert (j["warps"], j["stages"]) == (c.num_warps, c.num_stages), j


def test_pinned_triton_is_the_extras_pin():
    """The release the compile tests require is the one pyproject's gpu-compile extra installs (the test extra
    leaves triton out: only the slow compile tests use it)."""
    import os
    import tomllib

    with open(os.path.join(gc.ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    pins = [r for r in map(Requirement, extras["gpu-compile"]) if r.name == "triton"]
    assert [str(r.specifier) for r in pins] == [f"=={gc.PINNED_TRITON}"], pins
    assert not [r for r in map(Requirement, extras["test"]) if r.name == "triton"]


# --------------------------------------------------------------------------- compiled (triton)


def _compile_and_check(python, archs, hds, dtypes, tmp_path, variants=gc.FLASH_VARIANTS):
    rows = gc.run_matrix(gc.Matrix(archs, hds, dtypes), gc.Compiler(python, 2), str(tmp_path), variants,
                        log=lambda *_: None)
    assert rows
    bad = [gc.fmt_row(r) for r in rows if not gc.ok(r)]
    assert not bad, "\n" + gc.HEADER + "\n" + "\n".join(bad)


@pytest.mark.slow  # 12-40 s: with the other kernel compile checks, on every kernel change
def test_compiles_spill_free_hd128_bf16(triton_python, tmp_path):
    _compile_and_check(triton_python, gc.ARCHS, (128,), ("bf16",), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", gc.ARCHS)
def test_compiles_spill_free_full_matrix(triton_python, arch, tmp_path):
    _compile_and_check(triton_python, (arch,), gc.HEAD_DIMS, gc.DTYPES, tmp_path)
