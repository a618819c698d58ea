"""Live check (not collected by pytest): jaxformer-saved Marian checkpoints read by transformers itself.

For a few random jaxformer Marian-shaped configs (tied / untied head, scaled / unscaled embeddings,
swish / gelu / relu): ``save_pretrained`` -> ``transformers.MarianMTModel.from_pretrained`` in a separate
Python with torch + transformers (``HF_PYTHON``, default ``/tmp/hfenv/bin/python``; see
``make_fixtures.py``) -> compare encoder output and logits on a right-padded batch, and greedy / 3-beam
``generate`` with :mod:`jaxformer.decode.translate`. Run from the repository root::

    .venv/bin/python tests/interop/check_marian_live.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode.translate import TranslationConfig, beam_translate, greedy_translate
from jaxformer.interop import save_pretrained
from jaxformer.interop.marian import translation_kwargs
from jaxformer.model.config import ModelConfig
from jaxformer.model.functional import init

HF_PYTHON = os.environ.get("HF_PYTHON", "/tmp/hfenv/bin/python")
NEW = 8

HF_SIDE = r"""
import sys, numpy as np, torch
from transformers import MarianMTModel
d = sys.argv[1]
z = np.load(d + "/inputs.npz")
model = MarianMTModel.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
src, mask, tgt = (torch.from_numpy(z[k]).long() for k in ("src", "mask", "tgt"))
with torch.no_grad():
    o = model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
    g = model.generate(src, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=int(z["new"]))
    b = model.generate(src, attention_mask=mask, num_beams=3, do_sample=False, max_new_tokens=int(z["new"]))
np.savez(d + "/hf.npz", logits=o.logits.numpy(), memory=o.encoder_last_hidden_state.numpy(),
         greedy=g.numpy(), beam=b.numpy())
"""

CONFIGS = {
    "tied_scaled_swish": dict(tie_embeddings=True, scale_embeddings=True, activation="silu"),
    "untied_unscaled_gelu": dict(tie_embeddings=False, scale_embeddings=False, activation="gelu"),
    "tied_scaled_relu": dict(tie_embeddings=True, scale_embeddings=True, activation="relu"),
}


def check(name: str, options: dict, root: Path) -> bool:
    config = ModelConfig(kind="encoder_decoder", vocab_size=97, d_model=48, n_layers=2, n_encoder_layers=3,
                         n_heads=4, d_ff=80, norm="layernorm", norm_position="post", position="sinusoidal",
                         sinusoidal_layout="halves", max_seq_len=40, use_bias=True, head_bias=True, init_std=0.3,
                         **options)
    _, state = init(config, jax.random.key(3))
    flat = nnx.to_flat_state(state)  # a non-zero logits bias, so a dropped final_logits_bias shows
    bias = dict(flat)[("logits_bias",)]
    bias.set_value(jax.random.normal(jax.random.key(4), bias.shape) * 0.5)
    out = save_pretrained(root / name, config, state)
    rng = np.random.default_rng(0)
    lengths = np.array([9, 5, 7])
    src = rng.integers(1, 96, (3, 9))
    mask = (np.arange(9)[None] < lengths[:, None]).astype(np.int64)
    src = np.where(mask == 1, src, 96)
    tgt = np.concatenate([np.full((3, 1), 96), rng.integers(1, 96, (3, 5))], axis=1)
    np.savez(out / "inputs.npz", src=src, mask=mask, tgt=tgt, new=NEW)
    subprocess.run([HF_PYTHON, "-c", HF_SIDE, str(out)], check=True, capture_output=True)
    hf = np.load(out / "hf.npz")

    model = nnx.merge(*init(config, jax.random.key(3))[:1], state)
    memory = model.encode(jnp.asarray(src, jnp.int32), lengths=jnp.asarray(lengths))
    logits = model.decode(jnp.asarray(tgt, jnp.int32), memory, memory_lengths=jnp.asarray(lengths))
    valid = mask.astype(bool)
    d_mem = float(np.abs(np.asarray(memory) - hf["memory"])[valid].max())
    d_log = float(np.abs(np.asarray(logits) - hf["logits"]).max())
    greedy = greedy_translate(model, src, lengths,
                              config=TranslationConfig(**translation_kwargs(out)).replace(max_new_tokens=NEW))
    beam = beam_translate(model, src, lengths, config=TranslationConfig(**translation_kwargs(out, beam=True)).replace(
        max_new_tokens=NEW, num_beams=3))
    same_g = greedy.shape == hf["greedy"].shape and bool((greedy == hf["greedy"]).all())
    same_b = beam.shape == hf["beam"].shape and bool((beam == hf["beam"]).all())
    ok = d_mem < 1e-4 and d_log < 1e-4 and same_g and same_b
    print(f"{name:24s} encoder max|diff| {d_mem:.2e}  logits max|diff| {d_log:.2e}  greedy equal {same_g}  "
          f"beam equal {same_b}  {'OK' if ok else 'FAIL'}")
    if not (same_g and same_b):
        print("  ours greedy", greedy.tolist(), "\n  hf   greedy", hf["greedy"].tolist())
        print("  ours beam  ", beam.tolist(), "\n  hf   beam  ", hf["beam"].tolist())
    return ok


def main() -> int:
    if not Path(HF_PYTHON).exists():
        print(f"{HF_PYTHON} not found: set HF_PYTHON to a Python with torch + transformers")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = [check(name, options, Path(tmp)) for name, options in CONFIGS.items()]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
