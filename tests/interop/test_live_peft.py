"""Live checks against ``peft`` itself (marked ``slow``; skipped where torch / transformers / peft are absent).

1. An adapter trained by jaxformer (``model: {hf: DIR, lora: ...}``) and written by ``jaxformer export --peft`` is
   loaded by ``PeftModel.from_pretrained`` on the same base, which then gives jaxformer's logits (float32, within
   1e-4); ``export --hf`` (merged) is loaded by ``transformers`` alone and gives them too.
2. ``make_peft_fixtures.py`` regenerates the committed peft fixtures byte for byte.

Run (a CPU build of torch; the pins are the fixtures')::

    python -m venv /tmp/peftenv
    /tmp/peftenv/bin/pip install torch==2.13.0 transformers==5.24.0 peft==0.21.2 -e '.[test,interop]'
    /tmp/peftenv/bin/python -m pytest -m slow tests/interop/test_live_peft.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxformer.cli import main  # noqa: E402
from jaxformer.model import apply  # noqa: E402
from jaxformer.train import config as C  # noqa: E402
from jaxformer.train.loop import train  # noqa: E402
from jaxformer.train.run_dir import load_run  # noqa: E402
from tests.interop.common import ATOL, FIXTURES, assert_regenerated  # noqa: E402
from tests.interop.hf_dirs import make_hf_llama  # noqa: E402
from tests.train.helpers import make_corpus  # noqa: E402


def _torch_logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.float().numpy()


@pytest.mark.filterwarnings("default")  # transformers' and peft's own warnings are not ours
@pytest.mark.parametrize("rslora, targets", [(False, None), (True, ["w_q", "w_v", "w_down"])])
def test_peft_loads_what_jaxformer_trained(tmp_path, rslora, targets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_hf_llama(tmp_path / "base")
    raw = {"seed": 0, "steps": 8, "batch_size": 4, "seq_len": 32,
           "model": {"hf": str(base), "lora": {"rank": 4, "alpha": 16, "rslora": rslora, "targets": targets}},
           "data": {"source": "text", "path": str(make_corpus(tmp_path / "corpus")), "val_fraction": 0.2},
           "optimizer": {"lr": 2e-2, "weight_decay": 0.0}, "schedule": {"kind": "constant"}, "mesh": {"data": 1},
           "checkpoint": {"every": 8}, "logging": {"progress": False, "tensorboard": False},
           "eval": {"at_end": False}}
    run = tmp_path / "run"
    train(C.from_dict(raw, "<test>"), run)
    assert main(["export", str(run), "--peft", str(tmp_path / "peft")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    _, trainer, params, _, _ = load_run(run)
    ids = np.random.default_rng(0).integers(3, 300, (2, 12))
    ours = np.asarray(jax.jit(apply, static_argnums=0)(trainer.graphdef, params, jnp.asarray(ids, jnp.int32)))

    torch.manual_seed(0)
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    plain = _torch_logits(AutoModelForCausalLM.from_pretrained(base, **kw), ids)
    assert np.abs(ours - plain).max() > 10 * ATOL  # the trained adapter changes the model
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, **kw), tmp_path / "peft")
    assert adapted.peft_config["default"].use_rslora is rslora
    np.testing.assert_allclose(_torch_logits(adapted, ids), ours, rtol=0, atol=ATOL)
    merged = _torch_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **kw), ids)
    np.testing.assert_allclose(merged, ours, rtol=0, atol=ATOL)
    np.testing.assert_allclose(_torch_logits(adapted.merge_and_unload(), ids), merged, rtol=0, atol=ATOL)


@pytest.mark.filterwarnings("default")
def test_peft_fixtures_regenerate_identically(tmp_path):
    from tests.interop import make_peft_fixtures

    assert make_peft_fixtures.main(["--out", str(tmp_path)]) == 0
    for name in make_peft_fixtures.FIXTURES:
        committed = FIXTURES / "peft" / name
        files = sorted(p.name for p in committed.iterdir())
        assert files == sorted(p.name for p in (tmp_path / name).iterdir())
        for f in (f for f in files if f not in ("expected.npz", "meta.json")):  # the adapter: byte for byte
            assert (tmp_path / name / f).read_bytes() == (committed / f).read_bytes(), f"{name}/{f}"
        with np.load(committed / "expected.npz") as c, np.load(tmp_path / name / "expected.npz") as r:
            assert_regenerated({k: r[k] for k in r.files}, {k: c[k] for k in c.files}, name)
        meta, again = (json.loads((d / "meta.json").read_text()) for d in (committed, tmp_path / name))
        assert meta["versions"]["peft"] == again["versions"]["peft"] == peft.__version__
        rounding = "max_abs_merged_vs_unmerged"  # fp32 rounding of a merge, measured: 9.1e-6 / 9.5e-6 (two builds)
        assert max(meta[rounding], again[rounding]) < 1e-4, name
        for m in (meta, again):
            m.pop("versions"), m.pop(rounding)
        assert meta == again, name
