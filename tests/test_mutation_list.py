"""``experiments/mutation.py`` stays runnable: every mutation's text matches its file exactly once and names test
files that exist (a refactor that moves the guarded code must re-point the mutation, not leave it to fail
only when someone runs the full mutation check)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_matches_once_and_its_tests_exist():
    spec = importlib.util.spec_from_file_location("mutation_list", ROOT / "experiments" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    matches = {m.name: (ROOT / m.path).read_text().count(m.old) for m in module.MUTATIONS}
    stale = {name: n for name, n in matches.items() if n != 1}
    assert not stale, f"mutations whose text does not match exactly once (name: matches): {stale}"

    def exists(test: str) -> bool:  # a file, or a node id "file::name[...]" whose function the file defines
        path, _, node = test.partition("::")
        file = ROOT / path
        return file.exists() and (not node or f"def {node.split('[')[0].split('::')[-1]}(" in file.read_text())

    missing = {m.name: t for m in module.MUTATIONS for t in m.tests if not exists(t)}
    assert not missing, f"mutations naming test files that do not exist: {missing}"
    assert len({m.name for m in module.MUTATIONS}) == len(module.MUTATIONS), "duplicate mutation names"
