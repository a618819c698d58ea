"""Issue 24's data-path measure: the Python frames of the library between ``jaxformer train`` (``cli.main``) and
the CPU attention op, and the files they span, read off the stack the first time each op is called (one
training step of ``experiments/configs/stdlib_bytes.yaml`` in a temporary directory; JAX's own frames left out).

    python experiments/data_path.py            # this tree
    PYTHONPATH=OTHER python experiments/data_path.py --root OTHER   # another checkout, e.g. a git worktree
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

OPS = ("dot_product_attention", "dense_attention", "xla_attention", "blockwise_attention")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    root = Path(ap.parse_args().root).resolve()
    package = str(root / "jaxformer") + "/"
    seen: dict[str, list[tuple[str, str]]] = {}

    def profile(frame, event, arg):
        name = frame.f_code.co_name
        if event == "call" and name in OPS and name not in seen and frame.f_code.co_filename.startswith(package):
            rows = [(s.filename.removeprefix(package), s.name) for s in traceback.extract_stack(frame)
                    if s.filename.startswith(package)]
            start = next(i for i, (f, n) in enumerate(rows) if (f, n) == ("cli.py", "main"))
            seen[name] = rows[start:]

    from jaxformer.cli import main as cli

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            cli(["train", str(root / "experiments/configs/stdlib_bytes.yaml"), "--run-dir", f"{out}/run",
                 "--steps", "1", "eval.at_end=false", "eval.every=1000", "eval.sample=null",
                 "eval.compare_compressors=false", "logging.tensorboard=false", "logging.progress=false"])
        finally:
            sys.setprofile(None)
    for name, rows in seen.items():
        print(f"{name}: {len(rows)} frames over {len({f for f, _ in rows})} files")
        print("  " + " -> ".join(f"{f}:{n}" for f, n in rows))


if __name__ == "__main__":
    main()
