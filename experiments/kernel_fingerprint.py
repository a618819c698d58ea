"""Fingerprints of every flash-attention kernel as lowered for real hardware, without one.

For each of five mask / logit cases (plain, causal, window + segments + kv lengths, ALiBi + softcap +
offset + scale, block-sparse with global tokens and random blocks) the forward and backward of
``flash_attention`` are exported for CUDA (each Pallas kernel's Triton IR, captured by
``../shared/tools/ttir_capture.py``) and for TPU (each kernel's Mosaic module), source locations
stripped, and hashed. A refactor that must not change the kernels (issue 24) leaves every hash equal:

    python experiments/kernel_fingerprint.py /tmp/before.json     # on the old tree
    python experiments/kernel_fingerprint.py /tmp/after.json --compare experiments/results/kernel_fingerprint.json

The hashes depend on the JAX version (its lowering), so compare runs of one environment.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "tools"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ttir_capture import capture  # noqa: E402

from pallas_kernels.flash_attention import flash_attention  # noqa: E402

B, T, S, N, K, H = 2, 96, 160, 4, 2, 64  # T, S not multiples of the blocks; GQA 2:1
rng = np.random.default_rng(0)
seg_q = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), 1), jnp.int32)
seg_k = jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), 1), jnp.int32)


def bmap(bq, bk):
    nq, nk = -(-T // bq), -(-S // bk)
    live = np.zeros((N, nq, nk), bool)
    for i in range(nq):
        live[:, i, max(0, i - 1):i + 2] = True
        live[:, i, 0] = True
    return live


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_seg_len": dict(causal=True, window=(40, 0), q_segment_ids=seg_q, kv_segment_ids=seg_k,
                           kv_lengths=jnp.array([150, 100], jnp.int32)),
    "alibi_softcap_offset": dict(alibi_slopes=jnp.linspace(0.1, 0.5, N), softcap=20.0, q_offset=10, scale=0.2),
    "sparse": dict(window=(32, 32), block_map=bmap, q_global=jnp.zeros((1, T), jnp.int32).at[0, 3].set(1),
                   kv_global=jnp.zeros((1, S), jnp.int32).at[0, 5].set(1),
                   random_kv_starts=jnp.asarray(rng.integers(-1, S - 16, (N, 2, T)), jnp.int32),
                   random_block_size=16),
}


def strip(text: str) -> str:
    """The IR text without its source locations (they name lines of the Python source)."""
    text = re.sub(r"loc\([^()]*(\([^()]*\))*[^()]*\)", "", text)
    text = re.sub(r"#loc\d*( = .*)?", "", text)
    return text



def fingerprints() -> dict:
    out = {}
    q = jnp.zeros((B, T, N, H), jnp.bfloat16); k = jnp.zeros((B, S, K, H), jnp.bfloat16)
    for name, kw in CASES.items():
        for backend in ("gpu", "tpu"):
            def grads(q, k, v, kw=kw, backend=backend):
                return jax.grad(lambda *a: jnp.sum(flash_attention(*a, backend=backend, **kw).astype(jnp.float32)),
                                argnums=(0, 1, 2))(q, k, v)
            if backend == "gpu":
                d = tempfile.mkdtemp()
                with capture(d) as files:
                    jax.export.export(jax.jit(grads), platforms=["cuda"], disabled_checks=[
                        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, k, k)
                texts = [strip(open(f).read()) for f in sorted(files)]
                names = [os.path.basename(f) for f in sorted(files)]
            else:
                from jax._src.pallas.mosaic import pallas_call_registration as reg
                got, orig = [], reg._lower_to_custom_call
                def hook(*a, **kw):
                    got.append(kw["mosaic_module"].operation.get_asm(enable_debug_info=False))
                    return orig(*a, **kw)
                reg._lower_to_custom_call = hook
                try:
                    jax.export.export(jax.jit(grads), platforms=["tpu"])(q, k, k)
                finally:
                    reg._lower_to_custom_call = orig
                texts = [strip(t) for t in got]
                names = [re.search(r"func.func @(\w+)", t).group(1) if re.search(r"func.func @(\w+)", t) else "mosaic" for t in got]
            out[f"{name}/{backend}"] = [(n, hashlib.sha256(t.encode()).hexdigest()[:16]) for n, t in zip(names, texts)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="write the fingerprints here (JSON)")
    ap.add_argument("--compare", help="a fingerprint JSON to compare with; exit 1 on any difference")
    args = ap.parse_args()
    got = json.loads(json.dumps({"jax": jax.__version__, "kernels": fingerprints()}))
    Path(args.out).write_text(json.dumps(got, indent=1) + "\n")
    if args.compare:
        want = json.loads(Path(args.compare).read_text())
        if want.get("jax") != got["jax"]:
            print(f"note: {args.compare} was made with jax {want.get('jax')}, this is {got['jax']}")
        diff = [k for k in want["kernels"] if want["kernels"][k] != got["kernels"].get(k)]
        print("identical lowerings" if not diff else f"changed: {', '.join(diff)}")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
