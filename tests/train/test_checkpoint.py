"""Checkpoints: resume, a corrupt latest checkpoint, restoring onto another mesh, stopping on NaN/inf."""

from __future__ import annotations

import contextlib
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.checkpoint import Checkpointer, IncompatibleCheckpointError, fingerprint
from jaxformer.train.loop import NonFiniteError, train
from jaxformer.train.metrics import read_metrics
from jaxformer.train.run_dir import UnrestorableRunError
from jaxformer.train.step import make_trainer
from tests.train.helpers import make_corpus, tiny_raw


def _cfg(corpus, **kw):
    return C.from_dict(tiny_raw(corpus, **kw), "<test>")


def _losses(run):
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def _steps(run):
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_fingerprint_is_each_leafs_sum_of_magnitudes_on_a_sharded_tree():
    """Against numpy's float64 sum of |x| per leaf (fp32 sums: 1e-6 relative), leaves sharded over 4 devices,
    replicated, and bf16."""
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    host = {"w": rng.normal(size=(64, 24)).astype(np.float32), "b": rng.normal(size=(24,)).astype(np.float32),
            "h": rng.normal(size=(8, 4)).astype(jax.numpy.bfloat16)}
    tree = {"w": jax.device_put(host["w"], jax.NamedSharding(mesh, P("fsdp"))),
            "b": jax.device_put(host["b"], jax.NamedSharding(mesh, P())), "h": jax.numpy.asarray(host["h"])}
    want = [float(np.abs(host[k].astype(np.float64)).sum()) for k in sorted(host)]  # tree leaves in key order
    assert fingerprint(tree) == pytest.approx(want, rel=1e-6)


def test_fingerprint_runs_as_one_program(caplog):
    """One compiled program for a tree never seen before, not one or two per leaf: on a mesh over several processes
    eager per-leaf sums (each a small collective program) hung two training processes at a checkpoint
    (``experiments/results/multihost.md``)."""
    tree = {"a": jax.numpy.ones((37, 13)), "b": jax.numpy.ones((41,)), "c": jax.numpy.ones((3, 5, 7), "bfloat16")}
    with caplog.at_level("WARNING", logger="jax"), jax.log_compiles():
        fingerprint(tree)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling ")]
    assert len(compiled) == 1, compiled


def test_corrupt_latest_checkpoint_warns_and_resumes_from_previous(corpus, tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(corpus, steps=6)
    train(cfg, run)
    ref = _losses(run)
    assert _steps(run) == [2, 4, 6]
    for f in (run / "checkpoints" / "6" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.warns(RuntimeWarning, match="checkpoint step 6 .* unreadable"):
        train(cfg, run)  # resumes at 4 and redoes 5, 6
    got = _losses(run)
    assert got == ref  # bit-identical replay of steps 5 and 6
    # the rows the first run wrote after step 4 were dropped: 5 and 6 once each
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "6.corrupt").is_dir() and 6 in _steps(run)


def test_a_run_whose_every_checkpoint_is_unreadable_is_refused_not_started_over(corpus, tmp_path):
    """With no checkpoint that restores, training from step 0 in the same directory would rewrite its metrics and
    start from the data position the failed restores had moved the iterator to: refused, on every later try too
    (the unreadable ones are set aside as ``STEP.corrupt``), the metrics as they were."""
    run = tmp_path / "run"
    cfg = _cfg(corpus, steps=4)
    train(cfg, run)
    assert _steps(run) == [2, 4]
    for step in (2, 4):
        for f in (run / "checkpoints" / str(step) / "state").rglob("*"):
            if f.is_file() and f.stat().st_size > 0:
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    metrics = (run / "metrics.jsonl").read_bytes()
    for first in (True, False):  # the first try sets them aside with a warning each; the second finds none left
        with (pytest.warns(RuntimeWarning, match="unreadable") if first else contextlib.nullcontext()), pytest.raises(
                UnrestorableRunError, match=r"no checkpoint restores \(set aside as unreadable: 2.corrupt, 4.corrupt "
                                            r"in .*; nothing else was changed\. To train from step 0"):
            train(cfg, run)
        assert (run / "metrics.jsonl").read_bytes() == metrics and _steps(run) == []


def test_an_aborted_restores_closed_loop_reports_are_dropped_and_others_kept(monkeypatch, tmp_path):
    """A restore that fails on a mesh leaves tensorstore reads that finish after orbax closed their event loop;
    each reported "RuntimeError: Event loop is closed" from asyncio as an unraisable exception (~50 tracebacks
    under the one warning, a mesh of 4 devices: the session's scratch reproduced 120 lines, 0 with the filter).
    The filter drops exactly those; any other unraisable report reaches the hook there was."""
    import asyncio
    import sys
    import types

    from jaxformer.train import checkpoint as ckpt

    got = []
    monkeypatch.setattr(sys, "unraisablehook", got.append)
    assert Checkpointer(tmp_path / "none").restore_latest({}, {}) is None  # every restore installs it first
    quiet = sys.unraisablehook
    ckpt._quiet_aborted_restores()  # once per process: not wrapped twice
    assert quiet is not got.append and quiet.jaxformer_quiet and sys.unraisablehook is quiet

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    try:
        raise RuntimeError("Event loop is closed")  # the same words from elsewhere than asyncio's loop
    except RuntimeError as e:
        elsewhere = e
    other = RuntimeError("something else")  # reported from asyncio's place: only the message tells them apart
    kept = [(other, closed.__traceback__), (elsewhere, elsewhere.__traceback__),
            (ValueError("Event loop is closed"), closed.__traceback__)]
    for exc, tb in [(closed, closed.__traceback__), *kept]:
        sys.unraisablehook(types.SimpleNamespace(exc_value=exc, exc_traceback=tb, exc_type=type(exc), err_msg=None,
                                                 object=None))
    assert [u.exc_value for u in got] == [exc for exc, _ in kept]


def test_checkpoint_whose_arrays_do_not_match_their_fingerprint_is_set_aside(corpus, tmp_path):
    """Silent corruption (arrays that load but are not what was saved) is caught by the parameter
    fingerprint: the checkpoint is moved aside and the run replays from the previous one."""
    import json

    run = tmp_path / "run"
    cfg = _cfg(corpus, steps=4)
    train(cfg, run)
    ref = _losses(run)
    meta = run / "checkpoints" / "4" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    saved["fingerprint"][0] *= 1.01  # as if one tensor changed on disk by 1%
    meta.write_text(json.dumps(saved))
    with pytest.warns(RuntimeWarning, match="checkpoint step 4 .* do not match the saved fingerprint"):
        train(cfg, run)  # resumes at 2 and redoes 3, 4
    assert _losses(run) == ref
    assert (run / "checkpoints" / "4.corrupt").is_dir() and _steps(run) == [2, 4]


def test_resume_continues_the_run(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, steps=3), run)
    train(_cfg(corpus, steps=5), run)
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert _steps(run) == [2, 3, 4, 5]
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r)


def test_checkpoint_of_another_config_is_refused_not_discarded(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, steps=2), run)
    other = _cfg(corpus, steps=4, optimizer={"lr": 3e-3, "clip_norm": None})  # one optax state fewer
    with pytest.raises(IncompatibleCheckpointError, match="do not fit this config.* optimizer.clip_norm "
                                                          r"\(saved 1.0, now None\); nothing was changed"):
        train(other, run)
    assert _steps(run) == [2] and not (run / "checkpoints" / "2.corrupt").exists()


def test_restore_onto_a_different_mesh(corpus, tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(corpus, steps=2)
    train(cfg, run)
    one = make_trainer(cfg, S.make_mesh(C.MeshConfig(data=1)))
    s1, _ = Checkpointer(run / "checkpoints", read_only=True).restore_latest(one.abstract_state, one.state_shardings)
    cfg8 = _cfg(corpus, steps=2, mesh={"data": 2, "fsdp": 2, "tensor": 2})
    eight = make_trainer(cfg8, S.make_mesh(cfg8.mesh))
    s8, meta = Checkpointer(run / "checkpoints", read_only=True).restore_latest(
        eight.abstract_state, eight.state_shardings)
    assert meta["step"] == 2 and int(s8["step"]) == 2
    w = s8["params"]["decoder"]["blocks"][0]["mlp"]["w_up"]
    assert w.sharding.spec == P("fsdp", "tensor") and len(w.sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s8)):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, steps=4), run)
    # lr 1e30: step 5's update overflows the parameter norm (and the loss) to inf/nan
    bad = _cfg(corpus, steps=8, optimizer={"lr": 1e30})
    with pytest.warns(RuntimeWarning, match="config differs"), \
            pytest.raises(NonFiniteError, match=r"at step 5: .*last good checkpoint: step 4"):
        train(bad, run)
    assert _steps(run) == [2, 4]
    s, meta = Checkpointer(run / "checkpoints", read_only=True).restore_latest(
        *(lambda t: (t.abstract_state, t.state_shardings))(make_trainer(bad, S.make_mesh(bad.mesh))))
    assert meta["step"] == 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(s["params"]))
