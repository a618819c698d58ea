"""Runs that start from a Hugging Face checkpoint (runs written back as one: :mod:`jaxformer.train.export`).

``model: {hf: DIR}`` in an experiment (:class:`jaxformer.train.config.HFModelConfig`) makes the
checkpoint's parameters those of step 0 (:func:`initial_state`; the directory is read for
weights only then) and its tokenizer the data's. The run directory keeps ``hf_source/``, a copy
of the checkpoint's ``config.json`` and tokenizer files (:func:`jaxformer.train.run_dir.copy_source`), so the run is
resumed, evaluated, sampled and exported without the original directory; the resolved
``config.yaml`` records where it came from (``hf_source``).
"""

from __future__ import annotations

from jaxformer.train import config as C

def load_checkpoint(cfg: C.ExperimentConfig, model, shardings: dict):
    """The parameters of ``cfg.hf_source`` as the model ``model`` (a ``ModelConfig``: the run's, or a LoRA
    run's base) holds them, each tensor placed straight onto ``shardings`` (a pure dict shaped like the model's
    state; stacked first with ``model.scan_layers``: :func:`jaxformer.model.stack_layers`): an ``nnx.State``.
    ValueError naming the checkpoint's config when it describes another model than ``model``."""
    from flax import nnx

    from jaxformer.interop.hf import config_where, load_pretrained
    from jaxformer.model import abstract_init

    _, placed = abstract_init(model)
    nnx.replace_by_pure_dict(placed, shardings)
    overrides = {"attention": {"impl": model.attention.impl},
                 **{k: getattr(model, k) for k in C.HF_TOP_OVERRIDES if k != "param_dtype"}}
    loaded, _, state = load_pretrained(cfg.hf_source, dtype=model.param_dtype, shardings=placed, **overrides)
    if loaded != model:
        diff = ", ".join(f"{k} (config {a!r}, checkpoint {b!r})" for k, a, b in C.diff(model, loaded))
        raise ValueError(f"{config_where(cfg.hf_source)} describes another model than this run's config: {diff}")
    return state


def initial_state(cfg: C.ExperimentConfig, trainer):
    """The train state at step 0 of a run from ``cfg.hf_source``: the checkpoint's parameters
    (:func:`load_checkpoint`) on the trainer's shardings and a fresh optimiser state (a LoRA run:
    :func:`jaxformer.train.lora.initial_state`)."""
    from flax import nnx

    state = load_checkpoint(cfg, cfg.model, trainer.state_shardings["params"])
    return trainer.init_state_from(nnx.to_pure_dict(state), cfg.seed)
