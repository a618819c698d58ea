"""The import direction of ../shared/DESIGN.md, checked on every import statement (lazy ones inside
functions included): arrows only point down ``cli -> serve, study -> train -> decode, interop -> model -> nn
-> ops -> pallas_kernels``; nothing but the command line imports ``serve`` or ``study``, nothing but ``cli``
and ``study`` imports ``train``, and ``pallas_kernels`` imports no part of jaxformer, flax, optax or orbax."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the jaxformer packages it may import (besides itself and jaxformer.typing). train -> decode is
# sideways (a run prints a sample through the engine), not up.
MAY_IMPORT = {
    "ops": set(),
    "nn": {"ops"},
    "model": {"nn", "ops"},
    "decode": {"model", "nn", "ops"},
    "interop": {"model", "nn", "ops"},
    "train": {"decode", "interop", "model", "nn", "ops"},
    "serve": {"decode", "interop", "model", "nn", "ops"},
    "study": {"train", "decode", "interop", "model", "nn", "ops"},
}
KERNEL_FORBIDDEN = ("jaxformer", "flax", "optax", "orbax")


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module == "jaxformer":  # `from jaxformer import train`: each name is a package
                out += [(node.lineno, f"jaxformer.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, module))
    return out


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "jaxformer" / "ops"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from . import y\nfrom ..nn import z\ndef f():\n    from jaxformer.train import loop\n"
                              "    import flax\nfrom jaxformer import study\nfrom .. import serve\n")
    assert sorted(imports(pkg / "x.py", tmp_path)) == [(1, "jaxformer.ops"), (2, "jaxformer.nn"),
                                                       (4, "jaxformer.train"), (5, "flax"), (6, "jaxformer.study"),
                                                       (7, "jaxformer.serve")]


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_jaxformer_packages_import_only_downwards(package):
    bad = []
    for path in sorted((ROOT / "jaxformer" / package).rglob("*.py")):
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] != "jaxformer" or len(parts) < 2 or parts[1] in (package, "typing"):
                continue
            if parts[1] not in MAY_IMPORT[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, f"jaxformer.{package} may import only {sorted(MAY_IMPORT[package])}:\n" + "\n".join(bad)


def test_the_kernels_import_nothing_of_jaxformer_flax_optax_or_orbax():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted((ROOT / "pallas_kernels").rglob("*.py"))
           for line, module in imports(path) if module.split(".")[0] in KERNEL_FORBIDDEN]
    assert not bad, "\n".join(bad)
