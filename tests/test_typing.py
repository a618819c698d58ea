"""The shape alphabet is real: annotations are checked at call time under pytest, einsums use its
letters, and the kernels' aliases live in ``pallas_kernels`` (which never imports ``jaxformer``)."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import jaxformer.typing
import pallas_kernels.typing
from jaxformer.ops import dot_product_attention, layer_norm
from pallas_kernels.flash_attention import reference
from pallas_kernels.paged_attention import paged_attention
from tests.attention_helpers import attention_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
checking = pytest.mark.skipif(os.environ.get("JAXFORMER_TYPECHECK", "1") == "0",
                              reason="JAXFORMER_TYPECHECK=0 switches runtime checking off")


@checking
@pytest.mark.parametrize("bad", ["rank", "head_dim", "batch", "dtype"])
def test_attention_shape_mistakes_fail_at_the_call(bad):
    q, k, v, _ = attention_inputs(2, 3, 5, 4, 2, 8)
    assert dot_product_attention(q, k, v).shape == q.shape
    k_bad = {"rank": k[0], "head_dim": k[..., :4], "batch": k[:1], "dtype": k.astype(jnp.int32)}[bad]
    with pytest.raises(jaxtyping.TypeCheckError, match="dot_product_attention"):
        dot_product_attention(q, k_bad, v)
    with pytest.raises(jaxtyping.TypeCheckError, match="dot_product_attention"):  # at trace time under jit
        jax.jit(dot_product_attention)(q, k_bad, v)


@checking
def test_letters_agree_across_arguments_and_results():
    x = jnp.ones((2, 3, 8))
    with pytest.raises(jaxtyping.TypeCheckError, match="layer_norm"):
        layer_norm(x, jnp.ones(6))  # D of x is 8, D of scale is 6
    q, k, v, _ = attention_inputs(2, 3, 5, 4, 2, 8)
    with pytest.raises(jaxtyping.TypeCheckError, match="reference"):
        reference(q, k, v, kv_lengths=jnp.array([3, 4, 5]))  # Lengths [B] with B=3, q has B=2
    pages = jnp.ones((2, 6, 4, 8))
    tables = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(jaxtyping.TypeCheckError, match="paged_attention"):
        paged_attention(jnp.ones((2, 4, 16)), pages, pages, tables, jnp.array([1, 2]))  # H 16 vs 8


def test_jaxformer_typing_reexports_the_kernels_aliases():
    assert set(pallas_kernels.typing.__all__) <= set(jaxformer.typing.__all__)
    for name in pallas_kernels.typing.__all__:
        assert getattr(jaxformer.typing, name) is getattr(pallas_kernels.typing, name), name


def _einsum_specs(path: pathlib.Path) -> set[tuple[int, str]]:
    """Every string constant shaped like an einsum spec: inline in ``einsum(...)`` or passed around
    (``nn.attention._project``, ``nn.mlp.dense``)."""
    return {(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"[A-Za-z.]+(,[A-Za-z.]+)*->[A-Za-z.]*", node.value)}


def test_einsums_use_only_alphabet_letters():
    files = sorted((ROOT / "jaxformer").rglob("*.py")) + sorted((ROOT / "pallas_kernels").rglob("*.py"))
    seen, outside = 0, []
    for path in files:
        for line, spec in sorted(_einsum_specs(path)):
            seen += 1
            letters = set(spec.replace("...", "")) - set(",->")
            if letters - set(pallas_kernels.typing.LETTERS):
                outside.append(f"{path.relative_to(ROOT)}:{line} {spec!r}")
    assert seen > 20
    assert not outside, "einsum letters outside the alphabet (pallas_kernels/typing.py LETTERS):\n" + "\n".join(outside)


def test_kernels_never_import_jaxformer_and_library_needs_no_checker():
    code = """
import importlib, pkgutil, sys
import pallas_kernels
for info in pkgutil.walk_packages(pallas_kernels.__path__, "pallas_kernels."):
    importlib.import_module(info.name)
bad = sorted({m.split(".")[0] for m in sys.modules} & {"jaxformer", "flax", "optax", "orbax", "beartype"})
assert not bad, bad
import jaxformer.model, jaxformer.ops, jaxformer.nn
assert "beartype" not in sys.modules, "the library imports beartype: it belongs to the test extra only"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
