"""Scanned models (``scan_layers: true``) at the Hugging Face boundary: a checkpoint holds per-layer tensors,
so loading stacks them, saving and ``export`` unstack them, and a fine-tune with ``model: {hf: DIR,
scan_layers: true}`` starts from the stacked checkpoint.

The checkpoint is the committed ``llama`` fixture (2 layers, 3 safetensors shards); the layout's reference
is plain indexing (scanned leaf ``[i]`` == per-layer block ``i``), and logits are compared with
transformers' own (``expected.npz``) within ``common.ATOL``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxformer.cli import main
from jaxformer.interop import load_pretrained, save_pretrained
from jaxformer.model import abstract_init, apply, per_layer_config
from jaxformer.train import config as C
from jaxformer.train.metrics import read_metrics
from jaxformer.train.run_dir import load_run
from tests.interop.common import ATOL, fixture, max_diff
from tests.train.helpers import make_corpus, tiny_raw, write_config

forward = jax.jit(apply, static_argnums=0)


def flat(state) -> dict:
    return {p: np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
            for p, v in (nnx.to_flat_state(state) if isinstance(state, nnx.State)
                         else nnx.traversals.flatten_mapping(state).items())}


def by_index(scanned: dict, n_layers: int) -> dict:
    """Per-layer flat params of scanned flat params, by plain indexing (block ``i`` is index ``i``)."""
    out = {}
    for p, a in scanned.items():
        if p[:2] == ("decoder", "blocks"):
            out.update({(*p[:2], i, *p[2:]): a[i] for i in range(n_layers)})
        else:
            out[p] = a
    return out


def tensors(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_load_and_save_a_scanned_model(tmp_path):
    ckpt, expected, _ = fixture("llama")
    config, graphdef, state = load_pretrained(ckpt)
    s_config, s_graphdef, s_state = load_pretrained(ckpt, scan_layers=True)
    assert s_config == config.model_copy(update={"scan_layers": True})
    scanned = flat(s_state)
    assert scanned[("decoder", "blocks", "self_attn", "w_q")].shape == (2, 32, 4, 8)
    assert_same_tensors(by_index(scanned, 2), flat(state))  # bit for bit, layers in order
    tokens = jnp.asarray(expected["input_ids"], jnp.int32)
    assert max_diff(forward(s_graphdef, s_state, tokens), expected["logits"], expected["attention_mask"]) < ATOL
    # saved per layer: the same files as the per-layer model's
    save_pretrained(tmp_path / "scanned", s_config, s_state)
    save_pretrained(tmp_path / "plain", config, state)
    assert_same_tensors(tensors(tmp_path / "scanned"), tensors(tmp_path / "plain"))
    assert (tmp_path / "scanned" / "config.json").read_text() == (tmp_path / "plain" / "config.json").read_text()
    assert_same_tensors(tensors(tmp_path / "plain"), tensors(ckpt))  # and the checkpoint's own tensors


@pytest.fixture(scope="module")
def scanned_run(tmp_path_factory):
    """2 steps of `jaxformer train` with model: {hf: <llama fixture>, scan_layers: true}."""
    tmp = tmp_path_factory.mktemp("scanned")
    ckpt = fixture("llama")[0]
    raw = tiny_raw(make_corpus(tmp / "corpus", n_files=8), steps=2, checkpoint={"every": 2, "keep": 1})
    raw["model"] = {"hf": str(ckpt), "scan_layers": True}
    run = tmp / "run"
    assert main(["train", str(write_config(tmp / "ft.yaml", raw)), "--run-dir", str(run)]) == 0
    return ckpt, run


def test_finetune_with_scan_layers_starts_from_the_checkpoint(scanned_run):
    """Step 1's loss is the per-layer checkpoint's own loss on the first batch (step 0's parameters)."""
    from jaxformer.train.corpus import build_corpus
    from jaxformer.train.loop import _train_iterator

    ckpt, run = scanned_run
    cfg = C.load(run / "config.yaml")
    assert cfg.model.scan_layers and cfg.hf_source == str(ckpt)
    _, graphdef, state = load_pretrained(ckpt)  # per layer
    batch = jax.tree.map(jnp.asarray, next(_train_iterator(cfg, build_corpus(cfg.data, tokenizer_path=ckpt))))
    logits = forward(graphdef, state, batch.tokens, positions=batch.positions,
                     segment_ids=batch.segment_ids)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch.targets[..., None], -1)[..., 0]
    first = float(jnp.sum(jnp.where(batch.loss_mask, nll, 0.0)) / batch.loss_mask.sum())
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(first, rel=1e-5)  # fp32: scan vs loop rounding only


def test_export_of_a_scanned_run_writes_its_layers(scanned_run, tmp_path):
    """`jaxformer export` of the scanned run writes what exporting the same weights per layer writes (the
    twin's state built here by indexing), and loads back to the run's parameters and logits."""
    ckpt, run = scanned_run
    out = tmp_path / "out"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    cfg, _, params, _, meta = load_run(run)
    assert meta["step"] == 2
    twin_config = per_layer_config(cfg.model)
    _, twin = abstract_init(twin_config)
    nnx.replace_by_pure_dict(twin, nnx.traversals.unflatten_mapping(by_index(flat(params), cfg.model.n_layers)))
    save_pretrained(tmp_path / "twin", twin_config, twin, hf_config=json.loads((ckpt / "config.json").read_text()))
    assert_same_tensors(tensors(out), tensors(tmp_path / "twin"))
    assert (out / "config.json").read_text() == (tmp_path / "twin" / "config.json").read_text()

    _, _, back = load_pretrained(out, scan_layers=True)
    assert_same_tensors(flat(back), flat(params))
    tokens = jnp.asarray(fixture("llama")[1]["input_ids"], jnp.int32)
    _, graphdef, per_layer = load_pretrained(out)
    np.testing.assert_allclose(forward(graphdef, per_layer, tokens),
                               forward(abstract_init(cfg.model)[0], params, tokens), rtol=0, atol=ATOL)
