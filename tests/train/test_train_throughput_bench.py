"""``experiments/bench/train_throughput.py`` at toy size: every contender's first loss agrees with the library's,
the library's variants compile to programs of their own, the PyTorch twin (where torch is installed) has the
library's parameter count, and the table and ratios print; the timed rounds time no contender's first step after
another's."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench


def _bench():
    return load_bench("train_throughput")


def test_timed_rounds_step_each_contender_once_untimed_before_its_timed_steps():
    """Fakes whose first step after another contender's costs 100 ms (the cost the untimed step keeps out of the
    timing) and every other step 1 ms: each round calls a contender with one batch, then with all of them, in turn,
    and the per-step times are those of the 1 ms steps (a first step timed would read >= 25 ms a step; the bound
    leaves 11 ms a step for a busy machine's late wake-ups)."""
    import time

    calls, last = [], [None]

    def contender(name):
        def run(bs):
            calls.append((name, len(bs)))
            for _ in bs:
                time.sleep(0.1 if last[0] != name else 0.001)
                last[0] = name
        return run

    batches = [object()] * 4
    times, cpu = _bench().timed_rounds({"a": contender("a"), "b": contender("b")}, batches, 3)
    assert calls == [("a", 1), ("a", 4), ("b", 1), ("b", 4)] * 3
    assert set(times) == set(cpu) == {"a", "b"} and all(len(t) == 3 for t in (*times.values(), *cpu.values()))
    assert all(0.001 <= t < 0.012 for ts in times.values() for t in ts), times


@pytest.mark.slow  # 20 s: the benchmark script end to end at a toy size
def test_train_throughput_bench_toy(capsys):
    import jax

    bench = _bench()
    with jax.numpy_rank_promotion("allow"):  # the hand-written step broadcasts implicitly, as users write it
        rows = bench.main(["--d-model", "64", "--layers", "1", "--seq-len", "128", "--batch", "4", "--steps", "1",
                           "--rounds", "1", "--before", "--no-chunks", "--einsum", "--scan-remat", "--vs-torch",
                           "--peak-tflops", "1", "--parts", "2", "--also-parts", "4"])
    out = capsys.readouterr().out
    assert {"library", "library before", "library no chunks", "library einsum", "library scan+remat",
            "library one part", "library 4 parts", "hand-written"} <= set(rows)  # the library's step runs 2 parts
    assert all(v > 0 for v in rows.values())
    assert "DISAGREE" not in out and out.count("(agree within") == len(rows) - 1
    assert "ratio library / library before tokens/s" in out and "MFU vs 1 TFLOP/s per process" in out
    assert ("compiled programs differ: library, library before, library no chunks, library einsum, "
            "library scan+remat, library one part, library 4 parts") in out
    assert "ratio library / library one part tokens/s" in out and "library: 2 part(s) a micro-batch" in out
    assert "ratio library 4 parts / library one part (one part) tokens/s" in out
    assert "ratio library scan+remat / library tokens/s" in out
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "torch is not importable here; skipped" in out
    else:
        assert "torch eager" in rows and "MISMATCH" not in out


@pytest.mark.slow  # 6 s
def test_also_parts_beside_a_one_part_library_step(capsys):
    """With the library's own step in one part, the other part counts are compared with it."""
    rows = _bench().main(["--d-model", "64", "--layers", "1", "--seq-len", "32", "--batch", "4", "--steps", "1",
                          "--rounds", "1", "--no-hand", "--parts", "1", "--also-parts", "2", "1"])
    out = capsys.readouterr().out
    assert set(rows) == {"library", "library 2 parts"}
    assert "library: 1 part(s) a micro-batch" in out and "--also-parts 1: the library's own step runs 1 part" in out
    assert "ratio library 2 parts / library (one part) tokens/s" in out


@pytest.mark.parametrize("n", [3, 0])
def test_also_parts_refuses_a_count_that_does_not_split_the_batch(n, capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--d-model", "64", "--layers", "1", "--seq-len", "32", "--batch", "4", "--also-parts", str(n)])
    err = capsys.readouterr().err
    assert ("--also-parts 3: micro-batch batch_size/grad_accum=4/1=4 does not split into parallel_parts=3 parts"
            if n == 3 else "--also-parts 0: a number of parts >= 1") in err


def test_torch_twin_matches_the_library_where_torch_is_installed():
    pytest.importorskip("torch")
    import jax

    bench = _bench()
    from types import SimpleNamespace

    from jaxformer.train import config as C
    from jaxformer.train import sharding as S
    from jaxformer.train.corpus import build_corpus
    from jaxformer.train.pipeline import TrainIterator
    from jaxformer.train.step import make_trainer

    args = SimpleNamespace(batch=2, seq_len=64, d_model=64, layers=2, heads=None, dtype="float32", attention="xla",
                           parts=None)
    cfg = bench.experiment(args)
    mesh = S.make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    state = trainer.init_state()
    batch = next(TrainIterator(build_corpus(C.DataConfig()), seq_len=64, batch_size=2, seed=0))
    step, n_params, _ = bench.torch_twin(cfg, jax.device_get(state["params"]), [batch])
    assert n_params == sum(x.size for x in jax.tree.leaves(state["params"]))
    losses = [float(step().detach()) for _ in range(3)]
    state, m = trainer.train_step(state, S.put_batch(batch, mesh))
    assert losses[0] == pytest.approx(float(m["loss"]), rel=1e-4)
    for _ in range(2):
        state, m = trainer.train_step(state, S.put_batch(batch, mesh))
    assert losses[-1] == pytest.approx(float(m["loss"]), rel=1e-3)  # same optimiser, same schedule, same batch


@pytest.mark.slow  # 10 s: the main job's config (RoPE) at one layer, its step compiled twice
def test_rope_fused_variant_times_the_main_jobs_step_before_the_tables_went_apart(capsys):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "stdlib_bpe.yaml"
    rows = _bench().main(["--config", str(config), "--set", "model.n_layers=1", "--parts", "1", "--steps", "1",
                          "--rounds", "1", "--rope-fused"])
    out = capsys.readouterr().out
    assert set(rows) == {"library", "library rope fused"} and all(v > 0 for v in rows.values())
    assert "compiled programs differ: library, library rope fused" in out and "(agree within" in out
    assert "ratio library / library rope fused tokens/s" in out
