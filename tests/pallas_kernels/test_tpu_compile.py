"""Every Pallas TPU kernel compiled for real TPU generations, without a TPU.

The cases are those of ``experiments/bench/tpu_compile.py`` (flash forward, forward + backward, all
mask features, block-sparse lists; paged decode plain and with GQA / ALiBi / softcap / window).

* Mosaic lowering for the TPU platform (``jax.export(..., platforms=["tpu"])``) runs on any CPU
  machine: it caught paged decode asking the default device (a CPU) for its TPU generation.
* Compiling through libtpu's compile-only client (layout, tiling, VMEM) needs libtpu, from the
  ``tpu-compile`` extra; those tests are skipped where it is not installed (the default test venv).
  One generation at bf16 / hd 128 runs by default; the whole matrix is ``slow``.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from tests.bench_scripts import load_bench

tc = load_bench("tpu_compile")

needs_libtpu = pytest.mark.skipif(not tc.libtpu_available(),
                                  reason="libtpu not installed (pip install -e '.[tpu-compile]')")

# Mosaic kernels each case holds (custom-call names); forward + backward is forward, dq and dk/dv.
FWD_BWD = {"flash_fwd_tpu", "flash_dq_tpu", "flash_dkv_tpu"}
KERNELS = {"flash_fwd": {"flash_fwd_tpu"}, "flash_fwd_bwd": FWD_BWD, "flash_features": FWD_BWD,
           "flash_sparse": FWD_BWD, "flash_blocks1024": FWD_BWD, "paged": {"paged_attention_tpu"},
           "paged_features": {"paged_attention_tpu"}}
# v4 has 16 MiB of VMEM in all: 1024 x 1024 tiles at hd 256 need more (17.3 MiB fp32, 17.8 MiB bf16).
IMPOSSIBLE = {("flash_blocks1024", "v4:2x2x1", dtype, 256) for dtype in ("fp32", "bf16")}


def test_cases_cover_every_kernel():
    assert set(KERNELS) == set(tc.KERNELS)


@pytest.mark.parametrize("kernel", list(tc.KERNELS))
def test_mosaic_lowers_for_tpu(kernel):
    """Lowering for the TPU platform from a CPU host: no rule may need the default device to be a TPU."""
    fn, avals = tc.KERNELS[kernel](jnp.bfloat16, 128)
    module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals).mlir_module()
    assert module.count("tpu_custom_call") == len(KERNELS[kernel])


def _scoped_vmem_limits(kernel, dtype, head_dim):
    """The scoped-VMEM limit each Mosaic kernel of a case asks for (None: the compiler's default)."""
    fn, avals = tc.KERNELS[kernel](tc.DTYPES[dtype], head_dim)
    module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals).mlir_module()
    limits = []
    for config in re.findall(r'backend_config = "(\{\\22custom_call_config.*?)"', module):
        size = re.search(r"scoped_memory_configs.*?size\\22: (\d+)", config)
        limits.append(int(size.group(1)) if size else None)
    return limits


def test_vmem_limit_raised_only_above_default_tiles():
    """Default tiles (the largest: hd 256 fp32, block-sparse side inputs) keep the compiler's default limit,
    so they compile as before; 1024 x 1024 tiles ask for more, within v5p's 64 MiB."""
    from pallas_kernels.flash_attention.tpu import VMEM_DEFAULT_LIMIT, VMEM_RAISED_LIMIT

    assert _scoped_vmem_limits("flash_sparse", "fp32", 256) == [None] * 3
    assert _scoped_vmem_limits("flash_features", "fp32", 256) == [None] * 3
    raised = _scoped_vmem_limits("flash_blocks1024", "fp32", 256)
    assert len(raised) == 3 and all(VMEM_DEFAULT_LIMIT < x <= VMEM_RAISED_LIMIT for x in raised), raised


def _check(kernel, topology, dtype, head_dim):
    r = tc.compile_case(kernel, topology, dtype, head_dim)
    assert r.ok, f"{kernel} {topology} {dtype} hd{head_dim}: {r.error}\n{getattr(r, 'traceback', '')}"
    assert set(r.vmem) == KERNELS[kernel], r.vmem
    assert r.hbm["argument"] > 0


@needs_libtpu
@pytest.mark.parametrize("kernel", [k for k in tc.KERNELS if k != "flash_blocks1024"])
def test_compiles_for_v5e_bf16_hd128(kernel):
    _check(kernel, "v5e:2x2", "bf16", 128)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("head_dim", tc.HEAD_DIMS)
@pytest.mark.parametrize("dtype", list(tc.DTYPES))
@pytest.mark.parametrize("topology", tc.TOPOLOGIES)
@pytest.mark.parametrize("kernel", list(tc.KERNELS))
def test_compiles_full_matrix(kernel, topology, dtype, head_dim):
    if (kernel, topology, dtype, head_dim) in IMPOSSIBLE:
        r = tc.compile_case(kernel, topology, dtype, head_dim)
        assert not r.ok and "vmem" in r.error.lower(), r.error
        return
    _check(kernel, topology, dtype, head_dim)


def test_mosaic_vmem_parses_custom_calls():
    line = ('  %flash_fwd_tpu.1 = (bf16[2,8]{1,0}) custom-call(%a), custom_call_target="tpu_custom_call", '
            'backend_config={"custom_call_config":{"body":"x"},"used_scoped_memory_configs":'
            '[{"memory_space":"1","offset":"0","size":"2322432"},{"memory_space":"2","size":"7"}]}')
    assert tc.mosaic_vmem(line + "\n  %other = f32[] add(%x, %y)\n") == {"flash_fwd_tpu": 2322432}
