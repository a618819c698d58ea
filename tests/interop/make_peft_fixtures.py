"""Build the peft adapter fixtures under ``tests/interop/fixtures/peft/<name>/``.

Each fixture is a LoRA adapter made by ``peft`` itself on one of the committed tiny random models
(``tests/interop/fixtures/llama``, ``.../qwen2``; their weights are not copied), with ``lora_A`` and
``lora_B`` re-drawn from N(0, 0.2^2) (peft starts B at zero, which would test nothing), saved by
``PeftModel.save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``), plus
``expected.npz`` (the base fixture's inputs and the adapted model's float32 logits, unmerged, and
after ``merge_and_unload``) and ``meta.json`` (versions, the LoRA settings, how far the adapter moves
the logits). jaxformer's tests read these with its own code; they need neither torch nor peft.

Regenerate (from the repository root)::

    python -m venv /tmp/peftenv
    /tmp/peftenv/bin/pip install torch==2.13.0 transformers==5.24.0 peft==0.21.2 safetensors tokenizers sentencepiece
    /tmp/peftenv/bin/python tests/interop/make_peft_fixtures.py [--out tests/interop/fixtures/peft]

(torch 2.13.0 is a CPU wheel in this machine's local store; elsewhere add
``--index-url https://download.pytorch.org/whl/cpu``.) Re-running with the same versions reproduces every file
byte for byte (seeded, single-threaded torch, fixed zip timestamps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SEED = 4321
STD = 0.2
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (base fixture, LoraConfig kwargs, what it covers)
FIXTURES = {
    "llama": ("llama", dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=ALL, use_rslora=False),
              "all seven projections; scale alpha / r = 2; GQA k/v [32, 4] -> B [16, 4]; untied head; a dropout "
              "rate that must not act in eval"),
    "qwen2": ("qwen2", dict(r=2, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                            use_rslora=True),
              "a subset of targets (q, v, down) on a model with q/k/v biases; rsLoRA scale alpha / sqrt(r) = 4.243 "
              "(alpha / r would be 3)"),
}


def make(out: Path, base_name: str, lora_kwargs: dict, covers: str) -> None:
    import peft
    import safetensors
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.interop.make_fixtures import save_npz, seed_all, write_json

    base_dir = Path("tests/interop/fixtures") / base_name  # relative: what base_model_name_or_path records
    seed_all(SEED)
    model = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with np.load(base_dir / "expected.npz") as z:
        ids, mask, base_logits = z["input_ids"], z["attention_mask"], z["logits"]
    pm = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(STD * torch.randn_like(p))
    pm.eval()
    with torch.no_grad():
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        logits = pm(input_ids=t_ids, attention_mask=t_mask).logits.float().numpy()
    pm.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's model card template: kilobytes of placeholders
    # target_modules is a set inside peft, written in hash order: sort it (else each run differs), keeping
    # peft's formatting (indent 2, sorted keys, no final newline)
    config = json.loads((out / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"])
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    merged = pm.merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(input_ids=t_ids, attention_mask=t_mask).logits.float().numpy()
    save_npz(out / "expected.npz", {"input_ids": ids, "attention_mask": mask, "logits": logits,
                                    "merged_logits": merged_logits})
    valid = mask.astype(bool)
    scale = lora_kwargs["lora_alpha"] / (lora_kwargs["r"] ** 0.5 if lora_kwargs["use_rslora"] else lora_kwargs["r"])
    write_json(out / "meta.json", {
        "base": str(base_dir), "covers": covers, "lora_config": lora_kwargs, "scale": round(scale, 6),
        "init": f"lora_A and lora_B re-drawn from N(0, {STD}^2) after get_peft_model (torch seed {SEED})",
        "versions": {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "safetensors": safetensors.__version__},
        "logits": "PeftModel(input_ids, attention_mask).logits, eval mode (no dropout), float32, eager attention; "
                  "merged_logits: after merge_and_unload()",
        "max_abs_adapter_effect": round(float(np.abs(logits - base_logits)[valid].max()), 4),
        "max_abs_merged_vs_unmerged": float(np.abs(logits - merged_logits)[valid].max()),
        "logits_std_valid": round(float(logits[valid].std()), 4),
        "files": sorted({p.name for p in out.iterdir()} | {"meta.json"}),
    })


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "fixtures" / "peft"))
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = Path(args.out).resolve()
    cwd = os.getcwd()
    os.chdir(REPO)  # base_model_name_or_path: the base fixture's path relative to the repository
    sys.path.insert(0, str(REPO))
    try:
        for name, (base, kwargs, covers) in FIXTURES.items():
            out = root / name
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            print(f"[peft/{name}] on {base}")
            make(out, base, kwargs, covers)
    finally:
        os.chdir(cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
