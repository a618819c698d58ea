"""LoRA training (jaxformer.train.lora) on a tiny random Llama checkpoint written by jaxformer itself.

One run of 6 steps (rank 4, dropout 0.1, a checkpoint every 2 steps) is shared: step 0 is the base exactly, only
the adapter has gradients and optimiser state, the base is bit-identical afterwards and never in a checkpoint,
the loss falls, a crashed run resumes to the same per-step losses, ``export --peft`` / ``--hf`` and
``--adapter`` give back the trained model, a moved or changed base is refused naming its path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer.cli import main
from jaxformer.interop import load_pretrained
from jaxformer.interop.peft import apply_adapter
from jaxformer.model import apply, lora_params
from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.lora import BASE_RECORD, base_digest, initial_state
from jaxformer.train.loop import train
from jaxformer.train.metrics import read_metrics
from jaxformer.train.run_dir import load_run
from jaxformer.train.step import make_trainer
from tests.interop.hf_dirs import make_hf_llama
from tests.train.helpers import make_corpus, write_config

TEXT = "def add(x, y):\n    return x + y  # the quick brown fox\n"
TOKENS = jnp.asarray([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48]], jnp.int32)
japply = jax.jit(apply, static_argnums=0)


def lora_raw(base: Path, corpus: Path, **top) -> dict:
    raw = {"seed": 0, "steps": 6, "batch_size": 4, "seq_len": 32,
           "model": {"hf": str(base), "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}},
           "data": {"source": "text", "path": str(corpus), "val_fraction": 0.2},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "schedule": {"kind": "constant"}, "mesh": {"data": 1},
           "checkpoint": {"every": 2, "keep": 5}, "logging": {"every": 1, "progress": False, "tensorboard": False},
           "eval": {"max_tokens": 256, "at_end": False}}
    raw.update(top)
    return raw


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = make_hf_llama(tmp / "base")
    corpus = make_corpus(tmp / "corpus")
    cfg = C.from_dict(lora_raw(base, corpus), "<test>")
    rows = []
    train(cfg, tmp / "run", on_step=lambda s, row: rows.append(row["loss"]))
    return dict(tmp=tmp, base=base, corpus=corpus, cfg=cfg, run=tmp / "run", losses=rows,
                digest=base_digest(base))


@pytest.fixture(scope="module")
def peft(lora_run, tmp_path_factory):
    """The run's adapter, exported once (``export --peft``) for the tests that start from it: its directory."""
    out = tmp_path_factory.mktemp("peft") / "peft"
    assert main(["export", str(lora_run["run"]), "--peft", str(out)]) == 0
    return out


def test_step_zero_is_the_base_model_exactly(lora_run):
    cfg = lora_run["cfg"]
    trainer = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
    state = initial_state(cfg, trainer)
    _, graphdef, base = load_pretrained(lora_run["base"])
    np.testing.assert_array_equal(japply(trainer.graphdef, trainer.model_params(state), TOKENS),
                                  japply(graphdef, base, TOKENS))
    assert not any(np.any(b) for p, b in nnx.traversals.flatten_mapping(state["params"]).items() if p[-1] == "b")


def test_only_the_adapter_is_trained_and_checkpointed(lora_run):
    cfg, run = lora_run["cfg"], lora_run["run"]
    _, trainer, params, _, meta = load_run(run)
    state_paths = [s.split(":")[0] for s in meta["signature"]]
    params_paths = [p for p in state_paths if p.startswith("['params']")]
    assert params_paths and all("_lora']['a']" in p or "_lora']['b']" in p for p in params_paths)
    moments = [p for p in state_paths if p.startswith("['opt_state']") and (".mu[" in p or ".nu[" in p)]
    assert len(moments) == 2 * len(params_paths)  # AdamW's two moments, for the adapter alone
    n_adapter = sum(np.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_state["params"]))
    assert n_adapter == lora_params(cfg.model) > 0
    # the base: bit-identical in the trainer after 6 steps, the files untouched, no copy in the run directory
    _, _, base = load_pretrained(lora_run["base"])
    flat_base = nnx.traversals.flatten_mapping(nnx.to_pure_dict(base))
    flat_frozen = nnx.traversals.flatten_mapping(trainer.frozen)
    for p, v in flat_base.items():
        np.testing.assert_array_equal(np.asarray(flat_frozen[p]), np.asarray(v), err_msg=str(p))
    assert base_digest(lora_run["base"]) == lora_run["digest"]
    assert json.loads((run / BASE_RECORD).read_text()) == lora_run["digest"]
    assert sorted(p.name for p in (run / "hf_source").iterdir()) == ["config.json", "tokenizer.json",
                                                                   "tokenizer_config.json"]
    assert not list(run.rglob("*.safetensors"))


def test_the_loss_falls(lora_run):
    losses = lora_run["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses


def test_a_crashed_run_resumes_to_the_same_losses(lora_run, tmp_path):
    """Dropout keys come from (rng, step, micro-batch): a resume from step 4 repeats steps 5-6 exactly."""
    cfg, run = lora_run["cfg"], tmp_path / "run"

    class Crash(Exception):
        pass

    def crash(step, row):
        if step == 5:
            raise Crash

    with pytest.raises(Crash):
        train(cfg, run, on_step=crash)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    again = []
    train(cfg, run, on_step=lambda s, row: again.append((s, row["loss"])))
    assert again == list(zip([5, 6], lora_run["losses"][4:]))
    assert [r["loss"] for r in read_metrics(run) if "loss" in r] == lora_run["losses"]


def test_a_bf16_base_exported_in_float32_keeps_the_trained_model(lora_run, tmp_path, capsys):
    """A LoRA run over a bfloat16 base (the README's advice for large bases) exported with ``--dtype float32``:
    the merge ``W + s A B`` is taken in float32 and rounded once, to the saved dtype, so the checkpoint computes
    what the run does (it was rounded to bfloat16 first: 1e-3 off here, 7% of a small adapter's effect)."""
    raw = lora_raw(lora_run["base"], lora_run["corpus"], steps=2)
    raw["model"] = {**raw["model"], "param_dtype": "bfloat16", "compute_dtype": "float32"}
    run = tmp_path / "run"
    train(C.from_dict(raw, "<test>"), run)
    _, trainer, params, _, _ = load_run(run)
    ours = japply(trainer.graphdef, params, TOKENS)
    assert main(["export", str(run), "--hf", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    capsys.readouterr()
    _, mg, ms = load_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(japply(mg, ms, TOKENS), ours, rtol=0, atol=1e-5)


def test_exports_give_back_the_trained_model(lora_run, tmp_path, capsys):
    run, base = lora_run["run"], lora_run["base"]
    cfg, trainer, params, _, _ = load_run(run)
    ours = japply(trainer.graphdef, params, TOKENS)
    assert main(["export", str(run), "--peft", str(tmp_path / "peft")]) == 0
    assert "as a peft adapter" in capsys.readouterr().out
    adapter_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"], adapter_cfg["lora_dropout"]) == (4, 8, 0.1)
    assert adapter_cfg["base_model_name_or_path"] == str(base) and not adapter_cfg["use_rslora"]
    config, graphdef, state = load_pretrained(base)
    _, lg, ls = apply_adapter(tmp_path / "peft", config, state)
    np.testing.assert_allclose(japply(lg, ls, TOKENS), ours, rtol=0, atol=1e-5)
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    _, mg, ms = load_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(japply(mg, ms, TOKENS), ours, rtol=0, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    # --adapter on eval (and generate: the same load_adapter) applies the exported adapter to the base
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["eval", "--hf", str(base), "--adapter", str(tmp_path / "peft"), "--text", str(tmp_path / "t.txt"),
                 "--json"]) == 0
    with_adapter = json.loads(capsys.readouterr().out)
    assert main(["eval", "--hf", str(tmp_path / "merged"), "--text", str(tmp_path / "t.txt"), "--json"]) == 0
    assert with_adapter["loss"] == pytest.approx(json.loads(capsys.readouterr().out)["loss"], abs=1e-5)
    assert with_adapter["adapter"] == str(tmp_path / "peft")
    assert main(["generate", str(run), "--adapter", str(tmp_path / "peft"), "--prompt", "def"]) == 2
    assert "--adapter PEFT_DIR goes with --hf DIR" in capsys.readouterr().err
    assert main(["export", str(run)]) == 2
    assert "give --hf OUT" in capsys.readouterr().err


def test_training_continues_from_a_peft_adapter(lora_run, peft):
    raw = lora_raw(lora_run["base"], lora_run["corpus"])
    raw["model"] = {"hf": str(lora_run["base"]), "adapter": "peft"}  # relative to the YAML file
    cfg = C.load(write_config(peft.parent / "cont.yaml", raw))
    assert cfg.adapter_source == str(peft) and cfg.model.lora == lora_run["cfg"].model.lora
    trainer = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
    state = initial_state(cfg, trainer)
    config, graphdef, base = load_pretrained(lora_run["base"])
    _, lg, ls = apply_adapter(peft, config, base)
    np.testing.assert_array_equal(japply(trainer.graphdef, trainer.model_params(state), TOKENS),
                                  japply(lg, ls, TOKENS))
    raw["model"]["lora"] = {"rank": 2}
    with pytest.raises(C.ConfigError, match="give lora .* or adapter .*, not both"):
        C.from_dict(raw, "<test>", base_dir=peft.parent)


def test_scanned_layers_train_the_same_adapter(lora_run, peft):
    """The same adapter (the run's, exported) trained one step on the same batch per layer and with
    ``scan_layers``: the same dropout masks, the same loss and gradient norm, the same adapter written out."""
    from jaxformer.interop.peft import adapter_tensors
    from jaxformer.train.packing import model_batch

    rows = np.random.default_rng(0).integers(3, 300, (4, 33))
    batch = S.put_batch(model_batch(rows, np.ones_like(rows), 0), S.make_mesh(C.MeshConfig(data=1)))
    out = {}
    for scan in (False, True):
        raw = lora_raw(lora_run["base"], lora_run["corpus"])
        raw["model"] = {"hf": str(lora_run["base"]), "adapter": str(peft), "scan_layers": scan}
        # AdamW's first step is lr * g / (|g| + eps): at the default eps 1e-8 an element whose gradient is near
        # 0 moves by lr * sign(g), so float rounding between the two layouts (the same sums in another order)
        # can move it by up to lr (seen: 8.5e-5 on one element of 128 under other XLA CPU emitters). eps 1e-3
        # bounds that sensitivity at lr / eps = 10 per unit of gradient rounding and keeps the step
        # proportional to small gradients, so equal adapters also say the gradients agree.
        raw["optimizer"]["eps"] = 1e-3
        cfg = C.from_dict(raw, "<test>")
        trainer = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
        state, m = trainer.train_step(initial_state(cfg, trainer), batch)
        out[scan] = float(m["loss"]), adapter_tensors(cfg.model, state["params"]), float(m["grad_norm"])
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    # the gradients' norm, before AdamW's scaling
    assert out[True][2] == pytest.approx(out[False][2], rel=1e-5) and out[False][2] > 0
    assert sorted(out[True][1]) == sorted(out[False][1])
    for k, v in out[False][1].items():
        np.testing.assert_allclose(out[True][1][k], v, rtol=0, atol=1e-6, err_msg=k)


def test_a_moved_or_changed_base_is_refused_naming_its_path(lora_run, tmp_path):
    base = Path(shutil.copytree(lora_run["base"], tmp_path / "base"))
    run = Path(shutil.copytree(lora_run["run"], tmp_path / "run"))
    text = (run / "config.yaml").read_text().replace(str(lora_run["base"]), str(base))
    (run / "config.yaml").write_text(text)
    record = json.loads((run / BASE_RECORD).read_text())
    (run / BASE_RECORD).write_text(json.dumps({**record, "path": str(base)}))
    load_run(run)  # the same weights at the recorded path: fine
    from jaxformer.train import lora as lora_module

    real_digest = lora_module.base_digest
    try:  # the files' sizes and times are those recorded: nothing is hashed again
        lora_module.base_digest = lambda path: pytest.fail("an unchanged base was hashed again")
        load_run(run)
    finally:
        lora_module.base_digest = real_digest
    weights = base / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    load_run(run)  # touched, not changed: hashed again, and the same
    base.rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"the base checkpoint {base} this LoRA run adapts is gone"):
        load_run(run)
    (tmp_path / "elsewhere").rename(base)
    tensors = load_file(base / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"the base checkpoint {base} changed since this LoRA run started"):
        load_run(run)


def test_lora_without_a_checkpoint_is_refused(tmp_path):
    raw = {"model": {"preset": "llama_tiny", "lora": {"rank": 4}}, "seq_len": 64}
    with pytest.raises(C.ConfigError, match="model.lora adapts a pretrained model"):
        C.from_dict(raw, "<test>")
    with pytest.raises(C.ConfigError, match=r"lora.targets \['w_in'\]: this model's projections are"):
        C.from_dict({"model": {"preset": "llama_tiny", "lora": {"targets": ["w_in"]}}}, "<test>", planning=True)


def test_info_plans_the_frozen_base_and_the_adapter(lora_run):
    from jaxformer.model import count_params
    from jaxformer.train.info import describe_experiment, format_info, preset_config

    cfg = lora_run["cfg"]
    trainer = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
    moments = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state["opt_state"])
                  if x.ndim >= 1 and x.size > 3)
    d = describe_experiment(cfg, n_devices=1)
    n = lora_params(cfg.model)
    assert d["trainable"] == n and d["params"] == count_params(cfg.model) == count_params(cfg.model.base) + n
    assert d["bytes_optimizer"] == moments == 2 * 4 * n and d["bytes_grads"] == 4 * n
    assert d["bytes_base"] == 4 * count_params(cfg.model.base) and d["bytes_params"] == d["bytes_base"] + 4 * n
    text = format_info("x", d)
    assert f"trainable         {n:,}  (" in text and "LoRA rank 4, alpha 8 (alpha/rank)" in text
    # a 1B-shaped plan: the base in bfloat16, the adapter's gradients and moments a rounding error beside it. Built
    # scanned (one abstract block, not 16: ~2 s less; the same leaves stacked, the same bytes); the unscanned plan
    # of a LoRA model is the tiny run's above
    full = describe_experiment(preset_config("llama3_1b", ["seq_len=256", "scan_layers=true"], 1), 1)
    lora = describe_experiment(preset_config("llama3_1b", ["seq_len=256", "scan_layers=true", "param_dtype=bfloat16",
                                                           "lora.rank=16"], 1), 1)
    assert lora["bytes_base"] * 2 == full["bytes_params"] and lora["trainable"] / lora["params"] < 0.01
    assert lora["bytes_total"] < 0.25 * full["bytes_total"]


@pytest.mark.slow
def test_sigkill_then_resume_matches_the_uninterrupted_run(lora_run, tmp_path):
    """As tests/train/test_resume.py, for a LoRA run (dropout on): SIGKILL after step 4's checkpoint, resume;
    the per-step losses are those of an uninterrupted run in a process like it."""
    from tests.train.helpers import killed_and_resumed

    cfg = write_config(tmp_path / "cfg.yaml", lora_raw(lora_run["base"], lora_run["corpus"]))
    want, got = killed_and_resumed(cfg, tmp_path, steps=6)
    assert got == want  # exact


def test_a_lora_step_in_parts_equals_one_part(lora_run):
    """``optimizer.parallel_parts: 2`` on a LoRA step (adapter gradients only, the frozen base beside the state), at
    dropout 0: the same loss, gradient norm and adapter after one step as in one part (the same sums in another
    order; AdamW's eps 1e-3 as in the scan test above, so a rounding-level gradient moves its weight by ~1e-5 x lr)."""
    from jaxformer.train.packing import model_batch

    rows = np.random.default_rng(1).integers(3, 300, (4, 33))
    batch = S.put_batch(model_batch(rows, np.ones_like(rows), 0), S.make_mesh(C.MeshConfig(data=1)))
    out = {}
    for parts in (1, 2):
        raw = lora_raw(lora_run["base"], lora_run["corpus"])
        raw["model"]["lora"] = {"rank": 4, "alpha": 8, "dropout": 0.0}
        raw["optimizer"] = {**raw["optimizer"], "eps": 1e-3, "parallel_parts": parts}
        cfg = C.from_dict(raw, "<test>")
        trainer = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
        assert trainer.spec.optimizer.parallel_parts == parts
        start = initial_state(cfg, trainer)
        dots = trainer.train_step.lower(start, batch).as_text().count("dot_general")
        state, m = trainer.train_step(start, batch)
        out[parts] = float(m["loss"]), float(m["grad_norm"]), jax.device_get(state["params"]), dots
    assert out[2][3] > out[1][3]  # the step does run in parts: each part's forward and backward in the program
    assert out[2][0] == pytest.approx(out[1][0], rel=1e-6)
    assert out[2][1] == pytest.approx(out[1][1], rel=1e-5) and out[1][1] > 0
    for a, b in zip(jax.tree.leaves(out[1][2]), jax.tree.leaves(out[2][2]), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
