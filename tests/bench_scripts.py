"""Import a script of ``experiments/bench/`` as a module, so its tests call its functions in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"


def load_bench(name: str):
    """``experiments/bench/{name}.py`` as the module ``{name}_bench`` (registered in ``sys.modules``, which
    dataclasses and pickling need); the bench directory is on ``sys.path`` while it imports (its siblings)."""
    return load_script(BENCH / f"{name}.py", f"{name}_bench")


def load_script(path: Path, name: str):
    """The script at ``path`` as the module ``name``, as :func:`load_bench` loads a bench (``experiments/*.py``
    scripts import the bench directory's probes too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
