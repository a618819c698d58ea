"""``optimizer.parallel_parts``: each micro-batch computed as independent parts of one program, gradients summed.

The parts' summed gradients, cross-entropy and token count must equal the whole micro-batch's (the same sums in
another order: fp32 rounding, tolerance below), with and without ``grad_accum`` and on a data-parallel mesh;
each part gets its own micro-batch index (its dropout keys); "auto" takes 4 or 2 parts on CPU devices for a
micro-batch of enough work whose rows split so, for models that are not too large, and 1 otherwise; a count
that does not divide is refused naming the keys.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.packing import Batch
from jaxformer.train.step import StepSpec, accumulate, in_parts, make_trainer, model_graphdef, model_loss, \
    resolve_parts
from tests.train.helpers import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("parts") / "c", 4)


def packed_batch(rng, b: int, t: int) -> Batch:
    """Random tokens in two packed documents a row, the last positions unscored (padding)."""
    tokens = rng.integers(3, 264, (b, t)).astype(np.int32)
    seg = np.where(np.arange(t) < t // 3, 1, 2)[None].repeat(b, 0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(t), np.arange(t) - t // 3).astype(np.int32)
    mask = np.arange(t)[None].repeat(b, 0) < t - rng.integers(0, 4, (b, 1))
    return Batch(tokens=jnp.asarray(tokens), targets=jnp.asarray(np.roll(tokens, -1, 1)), loss_mask=jnp.asarray(mask),
                 positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))


# (1, 4): 3 s; the parts are one loop, summed against the whole batch by the default run's (2, 2), and more than
# two parts' rows and indices are test_each_part_gets_its_own_index_and_its_strided_rows's (3 parts). (1, 2): 2.4 s;
# the same in_parts wrapper as (2, 2), where accum 1 only skips the scan over micro-batches; two parts of one
# micro-batch against one part, through the whole train step, is test_a_data_parallel_step_in_parts_matches_one_device
@pytest.mark.parametrize("accum,parts", [pytest.param(1, 2, marks=pytest.mark.slow),
                                         pytest.param(1, 4, marks=pytest.mark.slow), (2, 2)])
def test_parts_sum_to_the_whole_batch(corpus, accum, parts):
    """Gradients, cross-entropy sum and token count of the parts against the one-part computation. Tolerance: the
    same fp32 sums in another order, relative to each leaf's largest entry: 1e-5."""
    cfg = tiny_config(corpus)
    graphdef = model_graphdef(cfg.model)
    params = make_trainer(cfg, S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1])).init_state()["params"]
    batch = packed_batch(np.random.default_rng(0), 8, 32)
    grad_fn = jax.grad(lambda p, b, i: model_loss(graphdef, p, b, 1e-4), has_aux=True)
    whole = jax.jit(lambda p, b: accumulate(grad_fn, p, b, accum))(params, batch)
    split = jax.jit(lambda p, b: accumulate(grad_fn, p, b, accum, parts))(params, batch)
    for want, got in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1e-30))
    assert float(split[2]) == float(np.asarray(batch.loss_mask).sum())  # every scored token counted once


def test_each_part_gets_its_own_index_and_its_strided_rows():
    """Part ``j`` of micro-batch ``i`` is handed index ``i * parts + j`` (its dropout keys) and rows ``j, j + parts,
    ...`` of the micro-batch (each device's rows of a part are its own)."""
    seen = []

    def grad_fn(params, b, i):
        seen.append((b, i))
        return {"g": b.sum(0)}, (b.sum(), jnp.float32(b.shape[0]))

    x = jnp.arange(12 * 2, dtype=jnp.float32).reshape(12, 2)
    grads, (ce, n) = in_parts(grad_fn, 3)(None, x, jnp.int32(5))
    assert [int(i) for _, i in seen] == [15, 16, 17]
    for j, (b, _) in enumerate(seen):
        np.testing.assert_array_equal(b, x[j::3])
    np.testing.assert_array_equal(grads["g"], x.sum(0))
    assert float(ce) == float(x.sum()) and float(n) == 12
    assert in_parts(grad_fn, 1) is grad_fn


MAIN_JOB_SHAPE = dict(model={"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "max_seq_len": 128},
                      seq_len=128, batch_size=8)  # 5.9 GFLOP a batch: the main job's model at batch 8


def test_auto_parts_rule():
    """On CPU devices 4 parts for a micro-batch of >= 40 GFLOP a device whose rows split in four, of a model of <= 30 M
    parameters; else 2 for >= 4 GFLOP whose rows split in two, of <= 100 M; else 1; always 1 with scan_layers. Each
    bar is pinned from both sides; the measured shapes resolve as measured (nanoGPT's batch of 16: 4, of 4: 2; 25 M
    parameters: 4, 85 M: 2; the main job: 2; the twin at 4 rows, 2.9 GFLOP: 1; the residual study's scanned
    layers: 1)."""
    from jaxformer.model import count_params, flops_per_token, presets
    from jaxformer.train.step import auto_parts

    m = presets.get("llama_tiny", vocab_size=264, d_model=128, n_layers=4, max_seq_len=128)
    row = flops_per_token(m, 128) * 128
    assert 6 * row >= 4e9 > 4 * row  # 6 rows of 128 tokens clear 2 parts' bar, 4 do not
    assert auto_parts(m, 6, 1, 128, 1, cpu=True) == 2 and auto_parts(m, 4, 1, 128, 1, cpu=True) == 1
    assert auto_parts(m, 8, 1, 128, 1, cpu=True) == 2
    assert auto_parts(m, 8, 1, 128, 1, cpu=False) == 1  # GPUs / TPUs
    assert auto_parts(m, 16, 1, 128, 2, cpu=True) == 2  # 8 rows a device
    assert auto_parts(m, 8, 1, 128, 2, cpu=True) == 1  # 4 rows a device: under the bar
    assert auto_parts(m, 16, 2, 128, 1, cpu=True) == 2
    assert auto_parts(m, 8, 2, 128, 1, cpu=True) == 1  # micro-batches of 4 rows
    assert auto_parts(m, 16, 1, 128, 16, cpu=True) == 1  # one row a device
    assert auto_parts(m, 18, 2, 128, 1, cpu=True) == 1  # micro-batches of 9 rows: 6.2 GFLOP, odd
    assert auto_parts(m, 16, 1, 128, 3, cpu=True) == 1  # rows that do not split over the devices
    scanned = presets.get("llama_tiny", vocab_size=264, d_model=128, n_layers=4, max_seq_len=128, scan_layers=True)
    assert auto_parts(scanned, 16, 1, 128, 1, cpu=True) == 1 and auto_parts(scanned, 64, 1, 128, 1, cpu=True) == 1
    short = flops_per_token(m, 32) * 32
    assert 24 * short < 4e9 <= 26 * short  # the bar between 24 and 26 rows of 32 tokens
    assert auto_parts(m, 26, 1, 32, 1, cpu=True) == 2 and auto_parts(m, 24, 1, 32, 1, cpu=True) == 1
    four = 4 * int(np.ceil(40e9 / row / 4))  # the fewest rows, in fours, worth 40 GFLOP
    assert (four - 4) * row < 40e9 <= four * row
    assert auto_parts(m, four, 1, 128, 1, cpu=True) == 4
    assert auto_parts(m, four, 1, 128, 1, cpu=False) == 1
    assert auto_parts(m, 2 * four, 1, 128, 2, cpu=True) == 4  # per device
    assert auto_parts(m, 2 * four, 1, 128, 1, cpu=True) == 4
    assert auto_parts(m, 2 * four, 2, 128, 2, cpu=True) == 2  # micro-batches of `four` rows, `four / 2` a device
    assert auto_parts(m, 2 * (four - 4), 1, 128, 2, cpu=True) == 2  # the work is a device's: under 40 GFLOP each
    assert auto_parts(m, four - 4, 1, 128, 1, cpu=True) == 2  # under 40 GFLOP
    assert auto_parts(m, four + 2, 1, 128, 1, cpu=True) == 2  # rows that do not split in four

    def sized(d_model, n_layers):  # 4 rows of 128 tokens: >= 40 GFLOP at every size below
        model = presets.get("llama_tiny", vocab_size=264, d_model=d_model, n_layers=n_layers, max_seq_len=128)
        assert flops_per_token(model, 128) * 128 * 4 >= 40e9
        return count_params(model), auto_parts(model, 4, 1, 128, 1, cpu=True)

    assert sized(512, 10) == (29_280_768, 4) and sized(640, 7) == (31_958_400, 2)  # the 30 M cap
    assert sized(1024, 8) == (92_963_840, 2) and sized(1024, 9) == (104_516_608, 1)  # the 100 M cap
    nano = presets.get("gpt2_small", vocab_size=264, d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
    assert auto_parts(nano, 16, 1, 256, 1, cpu=True) == 4 and auto_parts(nano, 4, 1, 256, 1, cpu=True) == 2
    for d_model, n_layers, batch, want in ((512, 8, 16, 4), (768, 12, 8, 2)):  # 25 M and 85 M parameters
        gpt = presets.get("gpt2_small", vocab_size=264, d_model=d_model, n_layers=n_layers, n_heads=d_model // 64,
                          max_seq_len=256)
        assert auto_parts(gpt, batch, 1, 256, 1, cpu=True) == want, (d_model, n_layers)
    main_job = C.load(Path(__file__).resolve().parents[2] / "experiments" / "configs" / "stdlib_bpe.yaml")
    assert auto_parts(main_job.model, main_job.batch_size, main_job.optimizer.grad_accum, main_job.seq_len, 1,
                      cpu=True) == 2
    twin = presets.get("gpt2_small", vocab_size=264, d_model=128, n_layers=4, n_heads=4, max_seq_len=128)
    assert auto_parts(twin, 4, 1, 128, 1, cpu=True) == 1 and auto_parts(twin, 12, 1, 128, 1, cpu=True) == 2
    resid = C.load(Path(__file__).resolve().parents[2] / "experiments" / "configs" / "stdlib_bytes.yaml",
                   ["model.d_model=64", "model.n_layers=12", "model.scan_layers=true", "model.remat=true"])
    assert auto_parts(resid.model, resid.batch_size, 1, resid.seq_len, 1, cpu=True) == 1
    unscanned = resid.model.model_copy(update={"scan_layers": False})  # its 7.5 GFLOP unscanned: two parts
    assert auto_parts(unscanned, 12, 1, 128, 1, cpu=True) == 2


def test_auto_resolves_in_make_trainer(corpus):
    """The trainer resolves "auto" for its mesh (a fake mesh of GPUs: 1 part); the tests' tiny model stays at 1."""
    from types import SimpleNamespace

    one = S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1])
    four = S.make_mesh(C.MeshConfig(data=4), jax.devices()[:4])

    def parts(mesh, **top):
        cfg = tiny_config(corpus, **top)
        return resolve_parts(StepSpec.of(cfg), mesh, cfg.seq_len).optimizer.parallel_parts

    assert tiny_config(corpus).optimizer.parallel_parts == "auto"
    assert parts(one) == 1  # the tiny model: 0.05 GFLOP a batch
    assert parts(one, **MAIN_JOB_SHAPE) == 2 and parts(four, **MAIN_JOB_SHAPE) == 1  # 2 rows a device: 1.5 GFLOP
    gpus = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")]), shape={"data": 1, "fsdp": 1})
    assert parts(gpus, **MAIN_JOB_SHAPE) == 1
    assert parts(one, optimizer={"parallel_parts": 4}) == 4
    assert make_trainer(tiny_config(corpus, **MAIN_JOB_SHAPE), one).spec.optimizer.parallel_parts == 2


def test_unresolved_parts_are_refused():
    with pytest.raises(ValueError, match=r"parallel_parts='auto'.*resolve_parts"):
        in_parts(lambda p, b, i: None, "auto")


def test_info_counts_the_parts_gradients(corpus):
    from jaxformer.train.info import describe_experiment

    one = describe_experiment(tiny_config(corpus, optimizer={"parallel_parts": 1}, **MAIN_JOB_SHAPE), 1)
    two = describe_experiment(tiny_config(corpus, **MAIN_JOB_SHAPE), 1)  # auto: 2 on this CPU
    assert two["parallel_parts"] == 2 and two["bytes_grads"] == 2 * one["bytes_grads"]
    assert two["bytes_total"] - one["bytes_total"] == one["bytes_grads"]
    four = describe_experiment(tiny_config(corpus, optimizer={"parallel_parts": 4}, **MAIN_JOB_SHAPE), 1)
    assert four["parallel_parts"] == 4 and four["bytes_grads"] == 4 * one["bytes_grads"]


def test_a_data_parallel_step_in_parts_matches_one_device(corpus):
    """One optimiser step on 4 devices (data=4) with 2 parts against one device with 1 part: the same loss and
    gradient norm (fp32 rounding: 1e-5 relative), and parameters within the update's rounding."""
    batch = packed_batch(np.random.default_rng(1), 8, 32)
    out = []
    for mesh_cfg, devices, parts in ((C.MeshConfig(data=1), jax.devices()[:1], 1),
                                     (C.MeshConfig(data=4), jax.devices()[:4], 2)):
        trainer = make_trainer(tiny_config(corpus, optimizer={"parallel_parts": parts}),
                               S.make_mesh(mesh_cfg, devices))
        state, m = trainer.train_step(trainer.init_state(), S.put_batch(jax.device_get(batch), trainer.mesh))
        out.append((jax.device_get(state["params"]), {k: float(v) for k, v in m.items()}))
    (p1, m1), (p2, m2) = out
    for k in ("loss", "grad_norm", "n_tokens"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5), k
    # the first AdamW step moves each weight by about lr * sign(g): a gradient at the rounding's scale may
    # flip, so the parameters are compared through the mean change, which those few cannot move by lr / 10
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2))])
    assert diffs.mean() < 3e-3 / 10


def test_a_count_that_does_not_divide_is_refused(corpus):
    with pytest.raises(ValueError, match=r"not divisible by optimizer.parallel_parts=3"):
        tiny_config(corpus, optimizer={"parallel_parts": 3})
    with pytest.raises(ValueError, match=r"parallel_parts=2 parts of whole rows on each of data\*fsdp=8 devices"):
        make_trainer(tiny_config(corpus, optimizer={"parallel_parts": 2}),
                     S.make_mesh(C.MeshConfig(data=8), jax.devices()[:8]))
    with pytest.raises(ValueError):
        tiny_config(corpus, optimizer={"parallel_parts": 0})
