"""Tiny Hugging Face checkpoints written by jaxformer itself (the ``hf_llama_dir`` fixture of conftest.py).

:func:`make_hf_llama` writes a directory as ``transformers`` saves a ``LlamaForCausalLM`` with its fast tokenizer:
``config.json`` + ``model.safetensors`` (a random 2-layer jaxformer ``llama_tiny``, via ``save_pretrained``)
and ``tokenizer.json`` + ``tokenizer_config.json`` (a byte-level BPE trained in memory on a few sentences,
``<s>`` / ``</s>`` specials, BOS added to inputs as Llama's tokenizer does, no pad token, as Llama has none).
Nothing is downloaded; torch and transformers are not needed. :func:`with_likely_eos` copies one whose samples end soon.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A lazy dog sleeps in the warm sun, and the fox runs away.",
    "Pack my box with five dozen liquor jugs!",
    "How vexingly quick daft zebras jump over the fence?",
    "the cat sat on the mat; the dog sat on the log.",
    "def add(x, y):\n    return x + y  # numbers 0123456789\n",
]
BOS, EOS = "<s>", "</s>"


def make_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``path``; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
         "model_max_length": 128}, indent=2))
    return tok.get_vocab_size()


def make_hf_llama(path: Path, *, seed: int = 0, **model) -> Path:
    """A tiny Llama checkpoint directory at ``path`` (see the module docstring); ``model``: ModelConfig fields."""
    import jax

    from jaxformer.interop import save_pretrained
    from jaxformer.model import init, presets

    vocab = make_tokenizer(path)
    config = presets.get("llama_tiny", **{"vocab_size": vocab, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                                          "max_seq_len": 128, **model})
    _, state = init(config, jax.random.key(seed))
    save_pretrained(path, config, state, hf_config={"bos_token_id": token_id(path, BOS),
                                                    "eos_token_id": token_id(path, EOS),
                                                    "architectures": ["LlamaForCausalLM"]})
    return path


def token_id(path: Path, token: str) -> int:
    """The id of ``token`` in ``path/tokenizer.json``."""
    spec = json.loads((path / "tokenizer.json").read_text())
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    return ids[token]


def with_likely_eos(src: Path, dst: Path, eos_logit: float = 3.0) -> Path:
    """A copy of the Llama checkpoint ``src`` at ``dst`` whose EOS logit is about ``eos_logit`` at every position
    (every other logit near 0): sampling ends within a few tokens. Every token embedding gets a large constant in
    dimension 0, which dominates the final RMSNorm's output (~sqrt(D) e_0), and the head reads only EOS from it.
    """
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    emb, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]  # [V, D] both (untied)
    emb[:, 0] += 10.0
    head[:, 0] = 0.0
    head[token_id(dst, EOS), 0] = eos_logit / np.sqrt(emb.shape[1])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
