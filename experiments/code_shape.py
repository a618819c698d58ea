"""Issue 24's measures of the code's shape: functions by parameter count (``self`` / ``cls`` not counted,
``*args`` / ``**kwargs`` one each) over ``jaxformer/``, ``pallas_kernels/`` and ``experiments/``, and the
command line's length.

The issue's bar: no *library* function (``jaxformer/``, ``pallas_kernels/``) takes more than 8, except the
public entry points of DESIGN that mirror ``jax.nn.dot_product_attention``'s keyword surface and the
backends that take the same keywords (:data:`ENTRY_POINTS`), and Pallas kernel bodies, whose positional
parameters are the refs ``pallas_call`` passes, one per operand (a parameter named ``*_ref``): a body that
names its refs is what the issue asks for. The last line lists whatever else is over the bar.

    python experiments/code_shape.py            # counts, and every function with more than 8 parameters
    python experiments/code_shape.py --min 12   # list those with 12 or more
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("jaxformer", "pallas_kernels", "experiments")
LIBRARY = ("jaxformer/", "pallas_kernels/")
ENTRY_POINTS = {
    "dot_product_attention", "xla_attention", "blockwise_attention",          # and its backends impl="xla", "blockwise"
    "mask_rule", "flash_attention", "reference",
    "paged_attention", "paged_attention_partials_gpu", "paged_attention_partials_tpu", "paged_attention_reference",
    "generate",
}


def functions(root: Path = ROOT):
    """``(path:line, qualified name, parameter count, is a Pallas kernel body)`` of every function and method
    under :data:`TREES`."""
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            mod = ast.parse(path.read_text(), str(path))
            stack = [(mod, "")]
            while stack:
                node, prefix = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        a = child.args
                        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                        n = len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)
                        n += (a.vararg is not None) + (a.kwarg is not None)
                        kernel = tree == "pallas_kernels" and any(x.endswith("_ref") for x in names)
                        yield f"{path.relative_to(root)}:{child.lineno}", prefix + child.name, n, kernel
                        stack.append((child, prefix + child.name + "."))
                    elif isinstance(child, ast.ClassDef):
                        stack.append((child, prefix + child.name + "."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min", type=int, default=9, help="list the functions with at least this many parameters")
    args = ap.parse_args()
    rows = list(functions())
    print(f"{len(rows)} functions; >= 8 parameters: {sum(r[2] >= 8 for r in rows)}; > 8: "
          f"{sum(r[2] > 8 for r in rows)}; >= 12: {sum(r[2] >= 12 for r in rows)}; "
          f"jaxformer/cli.py: {len((ROOT / 'jaxformer/cli.py').read_text().splitlines())} lines")
    for where, name, n, kernel in sorted(rows, key=lambda r: -r[2]):
        if n >= args.min:
            tag = " [kernel body]" if kernel else " [entry point]" if name in ENTRY_POINTS else ""
            print(f"  {n:3d}  {name}  ({where}){tag}")
    over = [f"{name} ({n}, {where})" for where, name, n, kernel in rows
            if n > 8 and where.startswith(LIBRARY) and not kernel and name not in ENTRY_POINTS]
    print(f"library functions over 8 parameters, entry points and kernel bodies aside: {len(over)}"
          + "".join(f"\n  {o}" for o in over))


if __name__ == "__main__":
    main()
