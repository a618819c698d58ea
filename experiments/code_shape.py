"""Issue 24's measures of the code's shape: functions by parameter count (``self`` / ``cls`` not counted,
``*args`` / ``**kwargs`` one each) over ``jaxformer/``, ``pallas_kernels/`` and ``experiments/``, and the
command line's length.

    python experiments/code_shape.py            # counts, and every function with more than 8 parameters
    python experiments/code_shape.py --min 12   # list those with 12 or more
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("jaxformer", "pallas_kernels", "experiments")


def functions(root: Path = ROOT):
    """``(path:line, qualified name, parameter count)`` of every function and method under :data:`TREES`."""
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
                        yield f"{path.relative_to(root)}:{child.lineno}", prefix + child.name, n
                        stack.append((child, prefix + child.name + "."))
                    elif isinstance(child, ast.ClassDef):
                        stack.append((child, prefix + child.name + "."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min", type=int, default=9, help="list the functions with at least this many parameters")
    args = ap.parse_args()
    rows = list(functions())
    print(f"{len(rows)} functions; >= 8 parameters: {sum(n >= 8 for *_, n in rows)}; > 8: "
          f"{sum(n > 8 for *_, n in rows)}; >= 12: {sum(n >= 12 for *_, n in rows)}; "
          f"jaxformer/cli.py: {len((ROOT / 'jaxformer/cli.py').read_text().splitlines())} lines")
    for where, name, n in sorted(rows, key=lambda r: -r[2]):
        if n >= args.min:
            print(f"  {n:3d}  {name}  ({where})")


if __name__ == "__main__":
    main()
