"""Tile sizes of the flash kernels: ``BlockSizes``, their checks and the bytes one tile needs."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.shapes import next_pow2

BACKENDS = ("gpu", "tpu")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. ``*_dkv`` / ``*_dq`` are the backward kernels' tiles; None means the forward ones."""

    block_q: int
    block_k: int
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None

    @classmethod
    def default(cls, backend: str) -> "BlockSizes":
        """Generic tiles per backend. The GPU dispatcher does not use these: it takes its tiles (and warps,
        stages) from :mod:`pallas_kernels.block_table`, per architecture, head dim and dtype."""
        if backend == "gpu":
            return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64)
        if backend == "tpu":
            return cls(block_q=512, block_k=512, block_q_dkv=512, block_k_dkv=512, block_q_dq=512, block_k_dq=512)
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")

    def resolved(self) -> "BlockSizes":
        """Fill the None backward sizes from the forward ones."""
        return BlockSizes(
            block_q=self.block_q,
            block_k=self.block_k,
            block_q_dkv=self.block_q if self.block_q_dkv is None else self.block_q_dkv,
            block_k_dkv=self.block_k if self.block_k_dkv is None else self.block_k_dkv,
            block_q_dq=self.block_q if self.block_q_dq is None else self.block_q_dq,
            block_k_dq=self.block_k if self.block_k_dq is None else self.block_k_dq,
        )

    def clipped(self, T: int, S: int, minimum: int = 1) -> "BlockSizes":
        """Shrink each q (k) tile to at most ``next_pow2(T)`` (``S``), never below ``minimum``."""
        r = self.resolved()
        cq = max(minimum, next_pow2(T))
        ck = max(minimum, next_pow2(S))
        return BlockSizes(
            block_q=min(r.block_q, cq),
            block_k=min(r.block_k, ck),
            block_q_dkv=min(r.block_q_dkv, cq),
            block_k_dkv=min(r.block_k_dkv, ck),
            block_q_dq=min(r.block_q_dq, cq),
            block_k_dq=min(r.block_k_dq, ck),
        )

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    def fit(self, H: int, itemsize: int, max_tile_bytes: int, minimum: int = 1) -> "BlockSizes":
        """Halve the larger tile of each (q, k) pair until :func:`tile_bytes` fits ``max_tile_bytes``."""
        r = self.resolved().as_dict()
        for q_name, k_name in (("block_q", "block_k"), ("block_q_dkv", "block_k_dkv"), ("block_q_dq", "block_k_dq")):
            while tile_bytes(r[q_name], r[k_name], H, itemsize) > max_tile_bytes:
                name = q_name if r[q_name] >= r[k_name] else k_name
                if r[name] // 2 < minimum:
                    break
                r[name] //= 2
        return BlockSizes(**r)


def tile_bytes(bq: int, bk: int, H: int, itemsize: int) -> int:
    """Bytes of one q tile, k and v tiles and the fp32 ``[bq, bk]`` logits."""
    return (bq + 2 * bk) * H * itemsize + bq * bk * 4


def check_block_sizes(block_sizes: BlockSizes, *, pow2: bool = True, minimum: int = 1,
                      multiple_of: int = 1, H: int | None = None, itemsize: int | None = None,
                      max_tile_bytes: int | None = None) -> BlockSizes:
    """Validate (and resolve) block sizes; raise ValueError naming the bad field.

    ``max_tile_bytes``: with ``H`` and ``itemsize``, reject tiles whose q, k, v
    blocks plus the fp32 ``[block_q, block_k]`` logits do not fit this budget.
    """
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    bs = block_sizes.resolved()
    for name, value in bs.as_dict().items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")
        if pow2 and not _is_pow2(int(value)):
            raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
        if value < minimum:
            raise ValueError(f"BlockSizes.{name}={value} is below the minimum {minimum} for this backend")
        if value % multiple_of:
            raise ValueError(f"BlockSizes.{name}={value} must be a multiple of {multiple_of} on this backend")
    if max_tile_bytes is not None and H is not None and itemsize is not None:
        for bq, bk, which in ((bs.block_q, bs.block_k, "forward"),
                              (bs.block_q_dkv, bs.block_k_dkv, "dkv"),
                              (bs.block_q_dq, bs.block_k_dq, "dq")):
            need = tile_bytes(bq, bk, H, itemsize)
            if need > max_tile_bytes:
                raise ValueError(
                    f"{which} tiles block_q={bq}, block_k={bk} with head dim H={H} need {need} bytes, "
                    f"more than the {max_tile_bytes} bytes this backend allows; use smaller blocks"
                )
    return bs
