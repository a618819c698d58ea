"""Block sizes, warps and pipeline stages of the GPU (Triton) kernels, per GPU architecture.

The GPU dispatchers (``flash_attention`` with ``backend="gpu"``, ``paged_attention``) read their
launch configuration here unless the caller passes ``block_sizes``: one :class:`KernelConfig` per
``(arch family, head dim, dtype, kernel)``. Every entry compiles for its architecture with no
register spill and within its shared memory per block, checked offline (no GPU) by
``experiments/bench/gpu_compile.py``, whose ``--search`` wrote the table (largest tiles that
compile spill-free in every mask variant; ``experiments/results/gpu_compile.md``) and
``tests/pallas_kernels/test_gpu_compile.py`` keeps it so.

Keys:

* arch family: ``"sm90"`` (compute capability 9.x-11.x: H100/H200, B200; 227 KiB shared per
  block), ``"sm80"`` (8.0 A100, 8.7; 163 KiB) or ``"sm86"`` (8.6, 8.9, 12.x: RTX 30/40/50, L4, L40;
  99 KiB; also any other or unknown device). Read from the first GPU at call (trace) time; with no GPU
  (CPU, interpret mode, ``jax.export`` for CUDA) the sm90 entry. ``$PALLAS_KERNELS_GPU_ARCH`` (e.g.
  ``sm80`` or ``8.0``) or :func:`target_arch` pins it.
* head dim: the padded head dim (power of two >= 16) rounded up to 64, 128 or 256.
* dtype: ``"bf16"`` (bfloat16 and float16) or ``"f32"``.
* kernel: ``"fwd"``, ``"dq"``, ``"dkv"`` (flash attention; ``block_q``, ``block_k`` their tiles)
  or ``"paged"`` (paged decode: warps and stages only; its tile is the caller's page).

Imports jax alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading

import jax.numpy as jnp

ARCH_FAMILIES = ("sm90", "sm80", "sm86")
DEFAULT_ARCH = "sm90"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "f32")
KERNELS = ("fwd", "dq", "dkv", "paged")
ENV_ARCH = "PALLAS_KERNELS_GPU_ARCH"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch configuration of one kernel: tile ``block_q x block_k`` (None for paged), Triton warps and stages."""

    block_q: int | None
    block_k: int | None
    num_warps: int
    num_stages: int


# BEGIN GENERATED TABLE (experiments/bench/gpu_compile.py --search rewrites this block)
TABLE = {
    ('sm90', 64, 'bf16', 'fwd'): KernelConfig(128, 128, 8, 2),
    ('sm90', 64, 'bf16', 'dq'): KernelConfig(128, 64, 8, 3),
    ('sm90', 64, 'bf16', 'dkv'): KernelConfig(64, 128, 8, 3),
    ('sm90', 64, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm90', 64, 'f32', 'fwd'): KernelConfig(32, 128, 8, 3),
    ('sm90', 64, 'f32', 'dq'): KernelConfig(64, 32, 8, 3),
    ('sm90', 64, 'f32', 'dkv'): KernelConfig(16, 128, 8, 3),
    ('sm90', 64, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm90', 128, 'bf16', 'fwd'): KernelConfig(128, 64, 8, 3),
    ('sm90', 128, 'bf16', 'dq'): KernelConfig(128, 64, 8, 3),
    ('sm90', 128, 'bf16', 'dkv'): KernelConfig(128, 32, 8, 3),
    ('sm90', 128, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm90', 128, 'f32', 'fwd'): KernelConfig(32, 32, 8, 3),
    ('sm90', 128, 'f32', 'dq'): KernelConfig(16, 64, 8, 3),
    ('sm90', 128, 'f32', 'dkv'): KernelConfig(16, 64, 8, 3),
    ('sm90', 128, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm90', 256, 'bf16', 'fwd'): KernelConfig(64, 64, 8, 2),
    ('sm90', 256, 'bf16', 'dq'): KernelConfig(32, 128, 8, 2),
    ('sm90', 256, 'bf16', 'dkv'): KernelConfig(64, 32, 8, 3),
    ('sm90', 256, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm90', 256, 'f32', 'fwd'): KernelConfig(32, 32, 8, 3),
    ('sm90', 256, 'f32', 'dq'): KernelConfig(64, 16, 8, 3),
    ('sm90', 256, 'f32', 'dkv'): KernelConfig(16, 32, 8, 3),
    ('sm90', 256, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 64, 'bf16', 'fwd'): KernelConfig(128, 64, 8, 3),
    ('sm80', 64, 'bf16', 'dq'): KernelConfig(128, 64, 8, 3),
    ('sm80', 64, 'bf16', 'dkv'): KernelConfig(32, 128, 8, 3),
    ('sm80', 64, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 64, 'f32', 'fwd'): KernelConfig(64, 32, 8, 3),
    ('sm80', 64, 'f32', 'dq'): KernelConfig(64, 32, 8, 3),
    ('sm80', 64, 'f32', 'dkv'): KernelConfig(64, 32, 8, 3),
    ('sm80', 64, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 128, 'bf16', 'fwd'): KernelConfig(64, 128, 8, 3),
    ('sm80', 128, 'bf16', 'dq'): KernelConfig(64, 128, 8, 2),
    ('sm80', 128, 'bf16', 'dkv'): KernelConfig(64, 64, 8, 3),
    ('sm80', 128, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 128, 'f32', 'fwd'): KernelConfig(64, 32, 8, 3),
    ('sm80', 128, 'f32', 'dq'): KernelConfig(64, 32, 8, 3),
    ('sm80', 128, 'f32', 'dkv'): KernelConfig(32, 32, 8, 2),
    ('sm80', 128, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 256, 'bf16', 'fwd'): KernelConfig(64, 64, 8, 2),
    ('sm80', 256, 'bf16', 'dq'): KernelConfig(64, 64, 8, 2),
    ('sm80', 256, 'bf16', 'dkv'): KernelConfig(64, 32, 8, 2),
    ('sm80', 256, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm80', 256, 'f32', 'fwd'): KernelConfig(32, 32, 8, 2),
    ('sm80', 256, 'f32', 'dq'): KernelConfig(32, 32, 8, 2),
    ('sm80', 256, 'f32', 'dkv'): KernelConfig(16, 32, 8, 3),
    ('sm80', 256, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 64, 'bf16', 'fwd'): KernelConfig(128, 128, 8, 2),
    ('sm86', 64, 'bf16', 'dq'): KernelConfig(128, 64, 8, 3),
    ('sm86', 64, 'bf16', 'dkv'): KernelConfig(32, 128, 8, 3),
    ('sm86', 64, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 64, 'f32', 'fwd'): KernelConfig(32, 128, 8, 2),
    ('sm86', 64, 'f32', 'dq'): KernelConfig(64, 32, 8, 3),
    ('sm86', 64, 'f32', 'dkv'): KernelConfig(16, 128, 8, 3),
    ('sm86', 64, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 128, 'bf16', 'fwd'): KernelConfig(64, 128, 8, 2),
    ('sm86', 128, 'bf16', 'dq'): KernelConfig(128, 64, 8, 2),
    ('sm86', 128, 'bf16', 'dkv'): KernelConfig(128, 32, 8, 2),
    ('sm86', 128, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 128, 'f32', 'fwd'): KernelConfig(32, 32, 8, 3),
    ('sm86', 128, 'f32', 'dq'): KernelConfig(16, 64, 8, 2),
    ('sm86', 128, 'f32', 'dkv'): KernelConfig(16, 64, 8, 2),
    ('sm86', 128, 'f32', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 256, 'bf16', 'fwd'): KernelConfig(64, 32, 8, 2),
    ('sm86', 256, 'bf16', 'dq'): KernelConfig(32, 32, 8, 3),
    ('sm86', 256, 'bf16', 'dkv'): KernelConfig(32, 32, 8, 2),
    ('sm86', 256, 'bf16', 'paged'): KernelConfig(None, None, 4, 3),
    ('sm86', 256, 'f32', 'fwd'): KernelConfig(32, 16, 8, 3),
    ('sm86', 256, 'f32', 'dq'): KernelConfig(16, 32, 8, 2),
    ('sm86', 256, 'f32', 'dkv'): KernelConfig(16, 32, 8, 2),
    ('sm86', 256, 'f32', 'paged'): KernelConfig(None, None, 8, 1),
}
# END GENERATED TABLE


_local = threading.local()


def _major_minor(arch) -> tuple[int, int] | None:
    if isinstance(arch, tuple):
        return int(arch[0]), int(arch[1]) if len(arch) > 1 else 0
    text = str(arch).strip().lower()
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.fullmatch(r"(?:sm_?)?(\d+)a?", text)
    if m:
        return int(m.group(1)) // 10, int(m.group(1)) % 10
    return None


def arch_family(arch) -> str:
    """Compute capability (``"9.0"``, ``"sm_80"``, ``"sm90a"``, ``86``, ``(8, 9)``) -> table family.

    8.0, 8.7 -> sm80 (163 KiB shared per block); 9.x, 10.x, 11.x -> sm90 (227 KiB); 8.6, 8.9, 12.x and
    anything else (7.x, a ROCm name) -> sm86, the smallest tiles (99 KiB): an unknown device gets the entries
    most likely to fit, not the largest.
    """
    mm = _major_minor(arch)
    if mm is None:
        return "sm86"
    major, minor = mm
    if major == 8:
        return "sm86" if minor in (6, 9) else "sm80"
    if major in (9, 10, 11):
        return "sm90"
    return "sm86"


def gpu_arch() -> str:
    """The arch family of the table lookups now: :func:`target_arch`, ``$PALLAS_KERNELS_GPU_ARCH``,
    the first GPU's compute capability, else :data:`DEFAULT_ARCH`."""
    pinned = getattr(_local, "arch", None)
    if pinned is not None:
        return pinned
    if os.environ.get(ENV_ARCH):
        return arch_family(os.environ[ENV_ARCH])
    import jax

    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend
        return DEFAULT_ARCH
    return arch_family(getattr(device, "compute_capability", None))  # None (not CUDA): the smallest tiles


@contextlib.contextmanager
def target_arch(arch):
    """Look up ``arch``'s entries inside the block (offline compile checks), whatever GPU is present.

    Jitted functions traced before keep the configuration they were traced with: clear JAX's caches
    (``jax.clear_caches()``) when switching architectures in one process."""
    old = getattr(_local, "arch", None)
    _local.arch = arch_family(arch)
    try:
        yield
    finally:
        _local.arch = old


@contextlib.contextmanager
def overriding(entries: dict):
    """Replace table entries (``{key: KernelConfig}``) inside the block (the block-size search)."""
    old = getattr(_local, "overrides", {})
    _local.overrides = {**old, **entries}
    try:
        yield
    finally:
        _local.overrides = old


def dtype_key(dtype) -> str:
    return "f32" if jnp.dtype(dtype).itemsize >= 4 else "bf16"


def head_dim_key(head_dim: int) -> int:
    """The smallest table head dim >= ``head_dim`` (the largest for anything above it)."""
    for h in HEAD_DIMS:
        if head_dim <= h:
            return h
    return HEAD_DIMS[-1]


def lookup(kernel: str, head_dim: int, dtype, arch: str | None = None) -> KernelConfig:
    """The entry for ``kernel`` at ``head_dim`` (padded) and ``dtype`` (a dtype or ``"bf16"``/``"f32"``)
    on ``arch`` (default :func:`gpu_arch`)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    key = (arch_family(arch) if arch is not None else gpu_arch(), head_dim_key(head_dim),
           dtype if dtype in DTYPES else dtype_key(dtype), kernel)
    found = getattr(_local, "overrides", {}).get(key) or TABLE.get(key)
    if found is None:
        found = TABLE[(DEFAULT_ARCH,) + key[1:]]
    return found
