"""Import a script of ``experiments/bench/`` as a module, so its tests call its functions in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"


def load_bench(name: str):
    """``experiments/bench/{name}.py`` as the module ``{name}_bench`` (registered in ``sys.modules``, which
    dataclasses and pickling need); the bench directory is on ``sys.path`` while it imports (its siblings)."""
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
