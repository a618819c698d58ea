"""Runs written back as checkpoints others read.

:func:`export_run` (``jaxformer export RUN --hf OUT``) writes a run's newest parameters (a LoRA run's
adapter merged into its base: :func:`jaxformer.interop.peft.merge_lora`) as a Hugging Face checkpoint,
keeping the original ``config.json``'s other keys (token ids, ``architectures``...) and its tokenizer; a run
trained from scratch is exported too when a supported family can express its model (else
:class:`~jaxformer.interop.HFConfigError`). :func:`export_peft` (``--peft OUT``) writes a LoRA run's
adapter as peft does.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.run_dir import (TOKENIZER_FILES, config_path, copy_files, from_gguf_file, load_run, run_tokenizer,
                                     source_dir)


def _bpe_specials(tok) -> tuple[dict, dict]:
    """``(tokenizer_config.json, config.json token ids)`` for a run's own byte-level BPE."""
    names = dict(zip(("bos", "eos", "pad"), tok.SPECIALS))
    return ({"tokenizer_class": "PreTrainedTokenizerFast", **{f"{k}_token": v for k, v in names.items()}},
            {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})


def export_run(run_dir: str | Path, out: str | Path, *, dtype: str | None = None) -> dict:
    """Write the newest checkpoint of ``run_dir`` as a Hugging Face checkpoint in ``out``.

    A run from ``model.hf`` keeps its original config.json's other keys and its tokenizer files;
    a run with a trained BPE gets its ``tokenizer.json`` and a ``tokenizer_config.json`` naming
    its special tokens; a byte-level run gets no tokenizer (a note says so). Returns what was
    written: ``{"step", "model_type", "path", "tokenizer_files"}``.
    """
    from flax import nnx

    from jaxformer.interop.hf import CONFIG, families, guess_model_type, save_pretrained
    from jaxformer.interop.rules import HFConfigError
    from jaxformer.model import abstract_init

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = C.load(run_dir / "config.yaml")
    hf_config, tokenizer_files = None, []
    source = source_dir(run_dir)
    if cfg.hf_source is not None and (source / CONFIG).is_file():
        hf_config = json.loads((source / CONFIG).read_text())
    elif cfg.data.tokenizer == "bpe":
        hf_config = _bpe_specials(run_tokenizer(cfg, run_dir))[1]
    model_type = (hf_config or {}).get("model_type") or guess_model_type(cfg.model)
    family = families().get(model_type)
    if family is None:
        raise HFConfigError(f"model_type={model_type!r} is not supported (supported: {sorted(families())})")
    family.config_to_hf(cfg.model)  # a model the family cannot express fails here, before any weight is read
    cfg, _, params, tok, meta = load_run(run_dir)
    model = cfg.model
    if model.lora is not None:  # a LoRA run: the adapter merged into its base, a checkpoint that stands alone
        from jaxformer.interop.peft import merge_lora

        model, params = merge_lora(model, params, dtype="float32")  # rounded once, to the saved dtype
    _, state = abstract_init(model)
    nnx.replace_by_pure_dict(state, params)
    # a scanned run (model.scan_layers) is written per layer by save_pretrained (unstack_layers)
    save_pretrained(out, model, state, model_type=model_type, hf_config=hf_config, dtype=dtype)
    if from_gguf_file(cfg):  # no tokenizer files to copy
        print(f"note: {run_dir} was trained from the GGUF file {cfg.hf_source}: its tokenizer is not written as "
              f"Hugging Face files (`jaxformer export RUN --peft DIR` writes the adapter alone)", file=sys.stderr)
    elif cfg.hf_source is not None:
        tokenizer_files = copy_files(source if source.is_dir() else cfg.hf_source, out,
                                     ("generation_config.json", *TOKENIZER_FILES))
    elif cfg.data.tokenizer == "bpe":
        shutil.copyfile(run_dir / "tokenizer.json", out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(_bpe_specials(tok)[0], indent=2) + "\n")
        tokenizer_files = ["tokenizer.json", "tokenizer_config.json"]
    else:
        print(f"note: {run_dir} was trained on {cfg.data.tokenizer!r} tokens ({cfg.data.source} data): "
              f"no Hugging Face tokenizer is written", file=sys.stderr)
    return {"step": int(meta["step"]), "model_type": model_type, "path": str(out),
            "tokenizer_files": tokenizer_files}


def export_peft(run_dir: str | Path, out: str | Path) -> dict:
    """Write the newest checkpoint's adapter of the LoRA run ``run_dir`` as a peft adapter in ``out``
    (:func:`jaxformer.interop.peft.save_adapter`; ``base_model_name_or_path``: the run's base). The base
    is not read. Returns ``{"step", "path", "base", "tensors"}``."""
    from jaxformer.interop.peft import save_adapter
    from jaxformer.train.checkpoint import Checkpointer
    from jaxformer.train.step import make_trainer

    run_dir = Path(run_dir)
    cfg = C.load(config_path(run_dir))
    if cfg.model.lora is None:
        raise ValueError(f"export --peft: {run_dir} is not a LoRA run (its config has no model.lora); "
                         f"export a full fine-tune with --hf OUT")
    trainer = make_trainer(cfg, shd.make_mesh(cfg.mesh))
    restored = Checkpointer(run_dir / "checkpoints", read_only=True).restore_latest(
        trainer.abstract_state, trainer.state_shardings)
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {run_dir / 'checkpoints'}")
    state, meta = restored
    save_adapter(out, cfg.model, state["params"], base_model_name_or_path=cfg.hf_source)
    n = 2 * len(cfg.model.lora_targets) * cfg.model.n_layers
    return {"step": int(meta["step"]), "path": str(out), "base": cfg.hf_source, "tensors": n}


def export_text(run_dir: str | Path, *, hf: str | Path | None = None, peft: str | Path | None = None,
                dtype: str | None = None) -> str:
    """``jaxformer export RUN (--hf OUT | --peft OUT)``: export, and say what was written and how to load it."""
    if (hf is None) == (peft is None):
        raise ValueError("export: give --hf OUT (a Hugging Face checkpoint) or --peft OUT (a LoRA run's adapter), "
                         + ("not both" if hf is not None else "one of them"))
    config_path(run_dir)  # "no such run directory" before anything is read
    if peft is not None:
        if dtype is not None:
            raise ValueError("export --peft: the adapter is written in float32, as peft saves it; drop --dtype")
        out = export_peft(run_dir, peft)
        return (f"exported the adapter of step {out['step']} of {run_dir} as a peft adapter: {out['path']} "
                f"(adapter_config.json, adapter_model.safetensors: {out['tensors']} tensors; base {out['base']})\n"
                f"  next  jaxformer generate --hf {out['base']} --adapter {out['path']} --prompt '...'  ·  peft: "
                f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({out['base']!r}), {out['path']!r})")
    out = export_run(run_dir, hf, dtype=dtype)
    files = ", ".join(["config.json", "*.safetensors", *out["tokenizer_files"]])
    return (f"exported step {out['step']} of {run_dir} as a {out['model_type']} checkpoint: {out['path']} ({files})\n"
            f"  next  jaxformer generate --hf {out['path']} --prompt '...'  ·  "
            f"transformers: AutoModelForCausalLM.from_pretrained({out['path']!r})")


def add_export_options(a) -> None:
    """``jaxformer export``'s arguments on a parser's ``add_argument`` ``a``."""
    a("run_dir")
    a("--hf", metavar="OUT", help="the directory to write (config.json, model.safetensors, tokenizer files)")
    a("--peft", metavar="OUT", help="a LoRA run: the directory to write its adapter to (adapter_config.json, "
      "adapter_model.safetensors), as peft's save_pretrained does")
    a("--dtype", choices=("float32", "bfloat16", "float16"), help="the saved tensors' dtype (default: the run's "
      "model.param_dtype)")


def export_command(args) -> int:
    """``jaxformer export RUN (--hf OUT | --peft OUT)``: :func:`export_text`'s lines printed."""
    print(export_text(args.run_dir, hf=args.hf, peft=args.peft, dtype=args.dtype))
    return 0

