"""Build the Hugging Face interop fixtures under ``tests/interop/fixtures/<name>/``.

Each fixture is a tiny, *randomly initialised* ``transformers`` model (built from a config; nothing is
downloaded), saved in the Hugging Face layout (``config.json``, ``*.safetensors``, tokenizer files), plus
``expected.npz`` (fixed inputs and transformers' own float32 outputs) and ``meta.json`` (what was run and
with which versions). jaxformer's loader tests read these files with jaxformer's own code and compare; they
need neither torch nor transformers. See ``tests/interop/fixtures/README.md`` for what each fixture covers.

Regenerate (from the repository root)::

    python -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers sentencepiece
    /tmp/hfenv/bin/python tests/interop/make_fixtures.py [--out tests/interop/fixtures] [--only gpt2,llama]

torch 2.13.0 is a CPU build in this machine's local wheel store. Elsewhere a plain ``pip install torch``
pulls a (large) CUDA build; ``pip install torch --index-url https://download.pytorch.org/whl/cpu`` is the
CPU-only alternative. The fixtures were recorded with transformers 5.24.0 and torch 2.13.0 (see each
``meta.json``). Re-running with the same versions reproduces every file bit for bit (everything is seeded,
torch runs single-threaded, and ``expected.npz`` is written with fixed zip timestamps).

This file lives under ``tests/`` but its name does not match ``test_*.py``, so pytest does not collect it,
and torch / transformers are imported only inside the functions below.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np

SEED = 1234
TEXT = "The quick brown fox jumps over the lazy dog."
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A lazy dog sleeps in the warm sun, and the fox runs away.",
    "Pack my box with five dozen liquor jugs!",
    "How vexingly quick daft zebras jump over the fence?",
    "the cat sat on the mat; the dog sat on the log.",
    "Jackdaws love my big sphinx of quartz, 12 times 34 is 408.",
    "Hello world: tiny models, tiny tokenizers, tiny tests.",
    "we jump, we run, we walk over the bridge and back again.",
]
BATCH = 2
SEQ = 10          # decoder-only / BERT sequence length (<= 12)
PAD_LEN = 3       # row 1 (second row) is right-padded by this many positions
GEN_PROMPT = 6    # generated_ids: model.generate(input_ids[:1, :GEN_PROMPT], max_new_tokens=GEN_NEW)
GEN_NEW = 6


# ----------------------------------------------------------------------------------------------------------
# determinism helpers

def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez_compressed, but with fixed zip timestamps and sorted keys, so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def write_json(path: Path, obj) -> None:
    """Sorted keys, 2-space indent, lists of scalars kept on one line (shapes, ids)."""
    import re

    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)

    def collapse(m):
        items = [x.strip() for x in m.group(1).split(",")]
        return "[" + ", ".join(items) + "]"

    text = re.sub(r"\[\s*((?:[-+0-9.eE]+|true|false|null|\"[^\"\[\]{}]*\")"
                  r"(?:,\s*(?:[-+0-9.eE]+|true|false|null|\"[^\"\[\]{}]*\"))*)\s*\]", collapse, text)
    path.write_text(text + "\n")


def seed_all(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------
# random re-initialisation: every parameter non-trivial, so a loader that drops a bias or swaps a norm fails

def _is_norm(module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name


def reinit_(model, *, extra_buffers: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list[str]:
    """weights ~ N(0, 0.2); biases ~ N(0, 0.1); norm weights ~ 1 + N(0, 0.2).

    ``skip``: parameter names left alone (e.g. Marian's sinusoidal position table, which is a fixed function,
    not a learnt weight). ``extra_buffers``: buffer names (saved in the state dict) to randomise as biases.
    Returns the names touched (for the log)."""
    import torch

    touched = []
    with torch.no_grad():
        seen = set()
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if id(p) in seen or full in skip:
                    continue
                seen.add(id(p))
                if _is_norm(module) and p_name == "weight":
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif p.ndim == 1:
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.2 * torch.randn_like(p))
                touched.append(full)
        for b_name, b in model.named_buffers():
            if b_name in extra_buffers:
                b.copy_(0.1 * torch.randn_like(b))
                touched.append(b_name)
    return touched


# ----------------------------------------------------------------------------------------------------------
# tokenizers (built in memory with the `tokenizers` library; sentencepiece for Marian)

def bytelevel_bpe(vocab_size: int, specials: list[str], bos: str | None = None):
    """GPT-2 style byte-level BPE (alphabet = bytes seen in the corpus; no unk). ``bos``: prepended by the
    post-processor (llama3 style); otherwise the ByteLevel post-processor (gpt2 / qwen2 / bloom style)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bid = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bid)])
    return tok


def metaspace_bpe(vocab_size: int):
    """Llama-2 / Mistral style: sentencepiece-like BPE (metaspace "▁", <unk>=0 <s>=1 </s>=2, BOS prepended).
    No byte fallback (256 byte tokens would not fit in a 96-token vocab): unknown characters map to <unk>."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def bert_wordpiece(vocab_size: int):
    """BERT style WordPiece. The vocab is built here rather than by WordPieceTrainer, whose id order is not
    reproducible from run to run: specials, then every character, then "##" + every character, then the most
    frequent whole words (count desc, then alphabetical) up to vocab_size."""
    from collections import Counter

    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    norm = normalizers.BertNormalizer(lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    words = Counter(w for line in CORPUS for w, _ in pre.pre_tokenize_str(norm.normalize_str(line)))
    chars = sorted({c for w in words for c in w})
    vocab = specials + chars + ["##" + c for c in chars if c.isalnum()]
    for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(vocab) >= vocab_size:
            break
        if w not in vocab:
            vocab.append(w)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(specials)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok


def save_fast_tokenizer(tok, out: Path, **special):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    hf.save_pretrained(out)
    return hf


def marian_tokenizer(out: Path, spm_vocab: int = 80):
    """Train a tiny unigram sentencepiece model in memory; write source.spm / target.spm (same model) and a
    vocab.json in the Helsinki-NLP layout: the spm's own ids (</s>=0, <unk>=1, pieces...) plus <pad> last."""
    import sentencepiece as spm
    from transformers import MarianTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=buf, vocab_size=spm_vocab, model_type="unigram",
        character_coverage=1.0, normalization_rule_name="identity", eos_id=0, unk_id=1, bos_id=-1, pad_id=-1,
        num_threads=1, seed_sentencepiece_size=1000,
        shuffle_input_sentence=False, hard_vocab_limit=True, minloglevel=2)
    model_bytes = buf.getvalue()
    tmp = out / "_spm_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "source.spm").write_bytes(model_bytes)
    (tmp / "target.spm").write_bytes(model_bytes)
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    vocab["<pad>"] = len(vocab)
    write_json(tmp / "vocab.json", vocab)
    tk = MarianTokenizer(str(tmp / "source.spm"), str(tmp / "target.spm"), str(tmp / "vocab.json"))
    tk.save_pretrained(out)
    shutil.rmtree(tmp)
    tk = MarianTokenizer.from_pretrained(out)
    return tk, len(vocab)


# ----------------------------------------------------------------------------------------------------------
# inputs and outputs

def decoder_inputs(vocab: int, pad_id: int, gen):
    import torch

    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - PAD_LEN:] = 0
    ids[1, SEQ - PAD_LEN:] = pad_id
    return ids, mask


def top2_margins(step_logits) -> np.ndarray:
    import torch

    out = []
    for lg in step_logits:          # one [B, V] tensor per generated step
        top = torch.topk(lg.float(), 2, dim=-1).values
        out.append((top[:, 0] - top[:, 1]).numpy())
    return np.stack(out, axis=1).astype(np.float32)   # [B, steps]


def step_logits(steps) -> np.ndarray:
    import torch

    return torch.stack([s.float() for s in steps], dim=1).numpy().astype(np.float32)   # [B, steps, V]


def greedy_generate(model, ids, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    import torch

    kwargs = {"max_new_tokens": GEN_NEW, "do_sample": False, "num_beams": 1}
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    return res.sequences.numpy().astype(np.int64), top2_margins(res.logits), step_logits(res.logits), kwargs


def generation_config_dict(model) -> dict:
    gc = model.generation_config
    return {k: v for k, v in sorted(gc.to_diff_dict().items()) if k != "transformers_version"}


EFFECTIVE_KEYS = ("max_length", "min_length", "num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size",
                  "repetition_penalty", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id",
                  "num_return_sequences", "suppress_tokens", "begin_suppress_tokens", "decoder_start_token_id",
                  "eos_token_id", "pad_token_id", "bos_token_id")


def effective_generation_params(model) -> dict:
    """What generate() uses when the call does not say: the model's generation_config, else transformers'
    GenerationConfig._get_default_generation_params() (in transformers 5 every field is None until generate)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig._get_default_generation_params()
    gc = model.generation_config
    out = {}
    for k in EFFECTIVE_KEYS:
        v = getattr(gc, k, None)
        out[k] = v if v is not None else defaults.get(k)
    return out


def tensor_listing(out: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = list(st.keys())
            for k in names:
                shapes[k] = list(st.get_slice(k).get_shape())
    return dict(sorted(shapes.items()))


def base_meta(name: str, family: str, model, hf_tok, text_ids, description: str, covers: list[str]) -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "name": name,
        "family": family,
        "model_class": type(model).__name__,
        "description": description,
        "covers": covers,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "tokenizers_version": tokenizers.__version__,
        "attn_implementation": "eager",
        "dtype": "float32",
        "seed": SEED,
        "tokenizer_class": type(hf_tok).__name__,
        "text": TEXT,
        "text_ids": [int(i) for i in text_ids],
        "text_ids_note": "tokenizer(text)['input_ids'] with add_special_tokens=True (the default)",
        "special_tokens": {k: [v, hf_tok.convert_tokens_to_ids(v)] for k, v in sorted(hf_tok.special_tokens_map.items())
                           if isinstance(v, str)},
        "tokenizer_len": len(hf_tok),
    }


def finish(out: Path, model, arrays: dict, meta: dict, reload_cls, check_keys=("logits",), reload_kwargs=None):
    """Reload the saved directory with transformers and check it reproduces the recorded outputs exactly
    (catches sharding / tying / config round-trip problems); then write expected.npz and meta.json."""
    import torch

    reloaded = reload_cls.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    inputs = {k: torch.from_numpy(arrays[k]) for k in ("input_ids", "attention_mask", "token_type_ids",
                                                        "decoder_input_ids", "decoder_attention_mask")
              if k in arrays}
    with torch.no_grad():
        o = reloaded(**inputs, **(reload_kwargs or {}))
    for k in check_keys:
        got = o[k].numpy()
        ref = arrays[k]
        if not np.array_equal(got, ref):
            raise AssertionError(f"{out.name}: reloaded {k} differs (max abs {np.abs(got - ref).max()})")
    meta["tensors"] = tensor_listing(out)
    meta["expected_arrays"] = {k: [str(v.dtype), list(v.shape)] for k, v in sorted(arrays.items())}
    lg = arrays["logits"]
    valid = lg if "attention_mask" not in arrays or lg.shape[:2] != arrays["attention_mask"].shape else \
        lg[arrays[("decoder_attention_mask" if "decoder_attention_mask" in arrays else "attention_mask")] == 1]
    meta["logits_std_valid"] = round(float(valid.std()), 4)
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(out)
    if list(auto(meta["text"])["input_ids"]) != meta["text_ids"]:
        raise AssertionError(f"{out.name}: AutoTokenizer reload encodes the text differently")
    meta["auto_tokenizer_class"] = type(auto).__name__
    for p in out.iterdir():
        p.chmod(0o644)
    meta["files"] = sorted(p.name for p in out.iterdir()) + ["expected.npz", "meta.json"]
    meta["files"] = sorted(set(meta["files"]))
    save_npz(out / "expected.npz", arrays)
    write_json(out / "meta.json", meta)
    for p in out.iterdir():
        p.chmod(0o644)
    print(f"  {out.name}: logits {lg.shape} std(valid)={meta['logits_std_valid']}; reload check ok")


# ----------------------------------------------------------------------------------------------------------
# decoder-only families

def _decoder_fixture(out: Path, name: str, family: str, config, model_cls, hf_tok, description, covers,
                     *, save_kwargs=None, extra_meta=None):
    import torch

    seed_all(SEED)
    model = model_cls(config)
    reinit_(model)
    model.eval()
    model.save_pretrained(out, safe_serialization=True, **(save_kwargs or {}))
    gen = torch.Generator().manual_seed(SEED + 1)
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    ids, mask = decoder_inputs(config.vocab_size, pad_id, gen)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    gen_ids, margins, gen_logits, gen_kwargs = greedy_generate(model, ids[:1, :GEN_PROMPT], mask[:1, :GEN_PROMPT])
    text_ids = hf_tok(TEXT)["input_ids"]
    arrays = {
        "input_ids": ids.numpy(), "attention_mask": mask.numpy(), "logits": logits.numpy().astype(np.float32),
        "text_ids": np.asarray(text_ids, dtype=np.int64),
        "generated_ids": gen_ids, "generated_top2_margin": margins, "generated_logits": gen_logits,
    }
    meta = base_meta(name, family, model, hf_tok, text_ids, description, covers)
    meta["inputs"] = {"batch": BATCH, "seq_len": SEQ, "padding": f"row 1 right-padded: last {PAD_LEN} positions "
                      f"attention_mask=0, input_ids={pad_id} there; compare logits only where attention_mask==1",
                      "position_ids": "default (arange(T)); right padding does not shift valid positions"}
    meta["generate"] = {"call": f"model.generate(input_ids[:1, :{GEN_PROMPT}], attention_mask=attention_mask[:1, "
                        f":{GEN_PROMPT}], **kwargs)", "kwargs": gen_kwargs,
                        "generation_config": generation_config_dict(model),
                        "effective_defaults": effective_generation_params(model),
                        "output": "generated_ids = prompt + new tokens (would stop early only at eos); "
                                  "generated_logits[b, step, :] = the raw next-token logits at each step (KV-cache "
                                  "decode check); generated_top2_margin[b, step] = top1 - top2 of those (tiny random "
                                  "models have near-ties: a margin below ~1e-3 could flip between implementations)"}
    meta.update(extra_meta or {})
    finish(out, model, arrays, meta, model_cls)
    return model, arrays


def make_gpt2(out: Path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = bytelevel_bpe(96, ["<|endoftext|>"])
    hf = save_fast_tokenizer(tok, out, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                             unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    eot = tok.token_to_id("<|endoftext|>")
    cfg = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=None,
                     activation_function="gelu_new", bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                     attn_implementation="eager")
    _decoder_fixture(out, "gpt2", "gpt2", cfg, GPT2LMHeadModel, hf,
                     "GPT-2: learnt absolute positions, Conv1D weights stored [in, out], fused c_attn, tied lm_head",
                     ["gpt2", "conv1d_layout", "fused_qkv", "tied_embeddings", "right_padding", "byte_level_bpe"])


def llama_tokenizer(out: Path):
    tok = metaspace_bpe(96)
    return save_fast_tokenizer(tok, out, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_llama(out: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = llama_tokenizer(out)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=None, attn_implementation="eager")
    _decoder_fixture(out, "llama", "llama", cfg, LlamaForCausalLM, hf,
                     "Llama: GQA 4 query / 2 kv heads, RoPE theta 1e4, RMSNorm, SwiGLU, untied lm_head, "
                     "safetensors sharded into several files with model.safetensors.index.json",
                     ["llama", "gqa", "rope_default", "untied_lm_head", "sharded_safetensors", "metaspace_bpe"],
                     save_kwargs={"max_shard_size": "40KB"})


# original_max_position_embeddings 64 with head_dim 16 and theta 5e5: wavelengths 2*pi*5e5**(i/8) =
# 6.3, 32.5, 167, ... against the thresholds 64/4 = 16 and 64/1 = 64, so frequency 0 is kept, 1 is smoothed
# and 2-7 are divided by 8 -- every branch of the llama3 rule is exercised (with 16 no frequency is kept).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_llama3(out: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = bytelevel_bpe(96, specials, bos="<|begin_of_text|>")
    hf = save_fast_tokenizer(tok, out, bos_token=specials[0], eos_token=specials[1])
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=tok.token_to_id(specials[0]),
                      eos_token_id=tok.token_to_id(specials[1]), pad_token_id=None, attn_implementation="eager")
    written = json.loads(cfg.to_json_string())
    rope_form = "rope_parameters" if "rope_parameters" in written else "legacy rope_theta + rope_scaling"
    print(f"  transformers {__import__('transformers').__version__} writes the rope config as: {rope_form}")
    if "rope_parameters" in written:
        print(f"    rope_parameters = {written['rope_parameters']}")
    # head_dim 16 and original_max_position_embeddings 16: which inv_freq the llama3 rule rescales
    inv = 500000.0 ** (-np.arange(0, 16, 2, dtype=np.float64) / 16)
    wl = 2 * np.pi / inv
    orig = LLAMA3_ROPE["original_max_position_embeddings"]
    lo, hi = orig / LLAMA3_ROPE["low_freq_factor"], orig / LLAMA3_ROPE["high_freq_factor"]
    kinds = ["kept" if w < hi else "scaled/8" if w > lo else "smoothed" for w in wl]
    print(f"    llama3 rope per frequency: {kinds}")
    _decoder_fixture(out, "llama3", "llama", cfg, LlamaForCausalLM, hf,
                     "Llama 3: RoPE theta 5e5 with llama3 frequency scaling (factor 8, low 1, high 4, original "
                     "max pos 64; head_dim 16 so kept, smoothed and scaled frequencies all occur), GQA 4:2, "
                     "tied embeddings (no lm_head.weight in the file). config.json in the form transformers "
                     "writes (see rope_config_form)",
                     ["llama3_rope_scaling", "tied_embeddings", "gqa", "rope_parameters_config", "byte_level_bpe",
                      "bos_via_post_processor"],
                     extra_meta={"rope_config_form": rope_form, "llama3_rope_frequency_kinds": kinds})


def make_llama3_legacy(out: Path, src: Path):
    """Same weights / outputs as llama3, config.json hand-edited into the legacy (transformers 4.x) form."""
    import torch
    from transformers import LlamaForCausalLM

    if not (src / "config.json").exists():
        raise SystemExit("llama3_legacy needs the llama3 fixture first (run with --only llama3,llama3_legacy)")
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    if "rope_parameters" not in cfg:
        raise SystemExit("transformers wrote the legacy rope form already; llama3_legacy is redundant")
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = {k: rp[k] for k in sorted(rp)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")   # as transformers writes it
    model = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    loaded = model.config.rope_parameters
    print(f"    legacy config loads as rope_parameters = {loaded}")
    with np.load(src / "expected.npz") as z:
        arrays = {k: z[k] for k in z.files}
    with torch.no_grad():
        lg = model(input_ids=torch.from_numpy(arrays["input_ids"]),
                   attention_mask=torch.from_numpy(arrays["attention_mask"])).logits.numpy()
    same = np.array_equal(lg, arrays["logits"])
    print(f"    legacy-config logits identical to llama3's: {same}")
    if not same:
        raise AssertionError("llama3_legacy logits differ from llama3")
    # a sanity check that the scaling matters at all: drop rope_scaling -> different logits
    cfg2 = dict(cfg)
    cfg2.pop("rope_scaling")
    from transformers import LlamaConfig

    m2 = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg2.items() if k not in ("architectures",
                                                                                     "transformers_version")},
                                      attn_implementation="eager"))
    m2.load_state_dict(model.state_dict())
    m2.eval()
    with torch.no_grad():
        lg2 = m2(input_ids=torch.from_numpy(arrays["input_ids"]),
                 attention_mask=torch.from_numpy(arrays["attention_mask"])).logits.numpy()
    diff = float(np.abs(lg2 - lg).max())
    print(f"    without llama3 scaling max |dlogits| = {diff:.4f} (scaling matters)")
    meta = json.loads((src / "meta.json").read_text())
    meta["name"] = "llama3_legacy"
    meta["description"] = ("llama3 with config.json rewritten into the legacy form (top-level rope_theta + "
                           "rope_scaling{rope_type: llama3, ...}); identical weights, tokenizer and outputs")
    meta["covers"] = ["llama3_rope_scaling", "legacy_rope_config", "tied_embeddings", "gqa"]
    meta["rope_config_form"] = "legacy rope_theta + rope_scaling (hand-edited)"
    meta["max_abs_logit_change_without_llama3_scaling"] = round(diff, 4)
    write_json(out / "meta.json", meta)


def make_qwen2(out: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = bytelevel_bpe(96, specials)
    hf = save_fast_tokenizer(tok, out, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    eot = tok.token_to_id("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      use_sliding_window=False, sliding_window=None, bos_token_id=None, eos_token_id=eot,
                      pad_token_id=eot, attn_implementation="eager")
    _decoder_fixture(out, "qwen2", "qwen2", cfg, Qwen2ForCausalLM, hf,
                     "Qwen2: q/k/v projections with biases (o_proj without), GQA 4:2, RoPE theta 1e6, "
                     "untied lm_head, no sliding window",
                     ["qwen2", "qkv_bias", "gqa", "untied_lm_head", "byte_level_bpe"])


def make_mistral(out: Path):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    hf = llama_tokenizer(out)
    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "attn_implementation": "eager"}
    cfg = MistralConfig(sliding_window=4, **common)
    model, arrays = _decoder_fixture(
        out, "mistral", "mistral", cfg, MistralForCausalLM, hf,
        "Mistral: sliding_window 4 over seq len 10 (each query sees itself and the 3 previous keys), GQA 4:2",
        ["mistral", "sliding_window", "gqa", "untied_lm_head", "metaspace_bpe"])
    nowin = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    nowin.load_state_dict(model.state_dict())
    nowin.eval()
    with torch.no_grad():
        lg = nowin(input_ids=torch.from_numpy(arrays["input_ids"]),
                   attention_mask=torch.from_numpy(arrays["attention_mask"])).logits.numpy()
    d = np.abs(lg - arrays["logits"]).max(axis=(0, 2))
    print(f"    sliding_window=4 vs None: max |dlogits| per position = {np.round(d, 4).tolist()}")
    assert np.all(d[:4] == 0) and np.all(d[4:] > 1e-3), "sliding window check failed"
    meta = json.loads((out / "meta.json").read_text())
    meta["sliding_window_check"] = {"max_abs_logit_diff_vs_no_window_per_position": np.round(d, 5).tolist(),
                                    "note": "positions 0-3 identical, 4+ differ: the window is in effect"}
    write_json(out / "meta.json", meta)


def _bloom(out: Path, name: str, hidden: int, heads: int, covers_extra: list[str]):
    from transformers import BloomConfig, BloomForCausalLM

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = bytelevel_bpe(96, specials)
    hf = save_fast_tokenizer(tok, out, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    cfg = BloomConfig(vocab_size=96, hidden_size=hidden, n_layer=2, n_head=heads, layer_norm_epsilon=1e-5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3, apply_residual_connection_post_layernorm=False,
                      attn_implementation="eager")
    slopes = _alibi_slopes(heads)
    _decoder_fixture(out, name, "bloom", cfg, BloomForCausalLM, hf,
                     f"BLOOM: ALiBi ({heads} heads), fused query_key_value stored per head as [q|k|v] blocks, "
                     "embedding LayerNorm, tied lm_head",
                     ["bloom", "alibi", "fused_qkv_per_head_interleaved", "word_embeddings_layernorm",
                      "tied_embeddings", "right_padding"] + covers_extra,
                     extra_meta={"alibi_slopes": slopes})


def _alibi_slopes(n: int) -> list[float]:
    import math

    p = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(p) - 3)))
    s = [base ** (i + 1) for i in range(p)]
    if p != n:
        extra = 2 ** (-(2 ** -(math.log2(2 * p) - 3)))
        s += [extra ** (2 * i + 1) for i in range(n - p)]
    return s


def make_bloom(out: Path):
    _bloom(out, "bloom", 32, 4, [])


def make_bloom_6heads(out: Path):
    _bloom(out, "bloom_6heads", 48, 6, ["alibi_non_power_of_two_heads"])


# ----------------------------------------------------------------------------------------------------------
# BERT

def make_bert(out: Path):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    tok = bert_wordpiece(96)
    hf = save_fast_tokenizer(tok, out, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                             mask_token="[MASK]", do_lower_case=True,
                             model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, type_vocab_size=2, max_position_embeddings=32, hidden_act="gelu",
                     layer_norm_eps=1e-12, pad_token_id=0, attn_implementation="eager")
    seed_all(SEED)
    model = BertForMaskedLM(cfg)
    reinit_(model)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(5, 96, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    ids[:, 0] = hf.cls_token_id
    ids[0, SEQ - 1] = hf.sep_token_id
    ids[1, SEQ - PAD_LEN - 1] = hf.sep_token_id
    ids[0, 3] = hf.mask_token_id
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - PAD_LEN:] = 0
    ids[1, SEQ - PAD_LEN:] = hf.pad_token_id
    tt = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    tt[:, SEQ // 2:] = 1
    tt[1, SEQ - PAD_LEN:] = 0
    with torch.no_grad():
        o = model(input_ids=ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
    text_ids = hf(TEXT)["input_ids"]
    pair = hf("the quick fox", "a lazy dog")
    arrays = {
        "input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": tt.numpy(),
        "logits": o.logits.numpy().astype(np.float32),
        "hidden_states": o.hidden_states[-1].numpy().astype(np.float32),
        "text_ids": np.asarray(text_ids, dtype=np.int64),
        "pair_ids": np.asarray(pair["input_ids"], dtype=np.int64),
        "pair_token_type_ids": np.asarray(pair["token_type_ids"], dtype=np.int64),
    }
    meta = base_meta("bert", "bert", model, hf, text_ids,
                     "BERT masked LM: post-LN encoder, token_type embeddings, padding mask, exact (erf) gelu, "
                     "MLM head (transform dense + gelu + LayerNorm, decoder tied to word embeddings + own bias)",
                     ["bert", "encoder", "padding_mask", "token_type_ids", "mlm_head", "tied_embeddings",
                      "wordpiece"])
    meta["inputs"] = {"batch": BATCH, "seq_len": SEQ,
                      "padding": f"row 1: last {PAD_LEN} positions attention_mask=0 ([PAD]); compare only valid "
                                 "positions", "token_type_ids": "second half 1 (0 on padding)",
                      "hidden_states": "outputs.hidden_states[-1] (output_hidden_states=True), the encoder's last "
                                       "layer output, before the MLM head"}
    meta["pair_text"] = ["the quick fox", "a lazy dog"]
    finish(out, model, arrays, meta, BertForMaskedLM, check_keys=("logits",))


# ----------------------------------------------------------------------------------------------------------
# Marian

def make_marian(out: Path):
    import torch
    from transformers import MarianConfig, MarianMTModel

    out.mkdir(parents=True, exist_ok=True)
    hf, vocab = marian_tokenizer(out)
    pad, eos = hf.pad_token_id, hf.eos_token_id
    cfg = MarianConfig(vocab_size=vocab, decoder_vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       activation_function="swish", max_position_embeddings=64, scale_embedding=True,
                       pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad, forced_eos_token_id=eos,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
    seed_all(SEED)
    model = MarianMTModel(cfg)
    pos_names = tuple(n for n, _ in model.named_parameters() if "embed_positions" in n)
    in_sd = set(model.state_dict())
    extra = tuple(n for n in ("final_logits_bias",) if n in in_sd)
    touched = reinit_(model, skip=pos_names, extra_buffers=extra)
    model.eval()
    # as in the Helsinki-NLP checkpoints' generation_config.json: never generate <pad>
    model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(out, safe_serialization=True)
    gen = torch.Generator().manual_seed(SEED + 1)
    ts, tt = 9, 7
    src = torch.randint(2, pad, (BATCH, ts), generator=gen, dtype=torch.int64)
    src[0, ts - 1] = eos
    src[1, ts - PAD_LEN - 1] = eos
    src[1, ts - PAD_LEN:] = pad
    smask = torch.ones(BATCH, ts, dtype=torch.int64)
    smask[1, ts - PAD_LEN:] = 0
    dec = torch.randint(2, pad, (BATCH, tt), generator=gen, dtype=torch.int64)
    dec[:, 0] = pad   # decoder_start_token_id
    dmask = torch.ones(BATCH, tt, dtype=torch.int64)
    dmask[1, tt - 2:] = 0
    dec[1, tt - 2:] = pad
    with torch.no_grad():
        o = model(input_ids=src, attention_mask=smask, decoder_input_ids=dec, decoder_attention_mask=dmask)
        g = model.generate(src, attention_mask=smask, num_beams=1, do_sample=False, max_new_tokens=8,
                           output_logits=True, output_scores=True, return_dict_in_generate=True)
        b = model.generate(src, attention_mask=smask, num_beams=3, do_sample=False, max_new_tokens=8)
    gc = generation_config_dict(model)
    print(f"    Marian generation_config (non-default entries): {gc}")
    text_ids = hf(TEXT)["input_ids"]
    arrays = {
        "input_ids": src.numpy(), "attention_mask": smask.numpy(),
        "decoder_input_ids": dec.numpy(), "decoder_attention_mask": dmask.numpy(),
        "logits": o.logits.numpy().astype(np.float32),
        "encoder_last_hidden_state": o.encoder_last_hidden_state.numpy().astype(np.float32),
        "generated_ids": g.sequences.numpy().astype(np.int64),
        "generated_top2_margin_raw": top2_margins(g.logits),
        "generated_top2_margin": top2_margins(g.scores),
        "generated_logits": step_logits(g.logits),
        "beam_ids": b.numpy().astype(np.int64),
        "text_ids": np.asarray(text_ids, dtype=np.int64),
    }
    meta = base_meta("marian", "marian", model, hf, text_ids,
                     "MarianMT encoder-decoder: sinusoidal positions (fixed, not random), scaled embeddings, "
                     "swish, shared embeddings tied with lm_head, final_logits_bias (randomised), "
                     "decoder_start = pad; greedy and beam generate",
                     ["marian", "encoder_decoder", "cross_attention", "sinusoidal_positions", "scale_embedding",
                      "final_logits_bias", "shared_embeddings", "padding_mask", "generate_greedy",
                      "generate_beam", "sentencepiece"])
    meta["randomised_buffers"] = list(extra)
    meta["not_randomised"] = list(pos_names) + ["(sinusoidal tables: computed by Marian, N(0,.2) would be wrong)"]
    meta["tokenizer_files"] = "source.spm / target.spm (same unigram sentencepiece model) + vocab.json " \
                              "(spm ids: </s>=0, <unk>=1, pieces..., then <pad> last); no sacremoses punctuation " \
                              "normaliser installed when recorded (identity)"
    meta["inputs"] = {"batch": BATCH, "src_len": ts, "tgt_len": tt,
                      "padding": f"src row 1: last {PAD_LEN} positions pad (attention_mask 0), eos before; "
                                 "decoder row 1: last 2 positions pad (decoder_attention_mask 0)",
                      "decoder_input_ids": "column 0 = decoder_start_token_id (= pad_token_id)"}
    meta["generate"] = {
        "greedy_call": "model.generate(input_ids, attention_mask=attention_mask, num_beams=1, do_sample=False, "
                       "max_new_tokens=8)",
        "beam_call": "model.generate(input_ids, attention_mask=attention_mask, num_beams=3, do_sample=False, "
                     "max_new_tokens=8)",
        "generation_config": gc,
        "effective_defaults": effective_generation_params(model),
        "notes": ("generated_ids / beam_ids start with decoder_start_token_id (= pad) and would be padded with pad "
                  "after an early eos. Logits processors in effect: bad_words_ids=[[pad]] (set in "
                  "generation_config.json as the Helsinki-NLP checkpoints do; <pad> logit -> -inf every step) and "
                  "forced_eos_token_id=eos (from config.json: at the last step allowed by max_length = 1 + "
                  "max_new_tokens = 9, every logit but eos -> -inf, so the 8th new token is always </s>). Beam: "
                  "length_penalty 1.0 (score = sum logprob / length), early_stopping False, no_repeat_ngram 0, "
                  "num_return_sequences 1. generated_logits / generated_top2_margin_raw: raw next-token logits per "
                  "step; generated_top2_margin: after the processors (inf at the forced-eos step)"),
    }
    meta["reinitialised"] = len(touched)
    finish(out, model, arrays, meta, MarianMTModel, check_keys=("logits", "encoder_last_hidden_state"))


MARIAN_GEN_BOOST = 2.5
MARIAN_GEN_NEW = 10
MARIAN_GEN_CASES = [  # (num_beams, length_penalty, early_stopping); 1 = greedy. One beam width: one compile
    (1, 1.0, False), (3, 1.0, False), (3, 2.0, True), (3, -1.0, "never"), (3, 0.5, False), (3, 2.0, "never"),
]


def make_marian_generate(out: Path, src: Path):
    """``generate`` on the marian fixture's model in the cases its ``beam_ids`` leave out.

    The marian fixture's greedy / beam outputs never end before the length limit (the random model repeats
    one token), so they exercise neither finished hypotheses competing, nor early stopping, nor the length
    penalty. Here ``final_logits_bias[eos] += MARIAN_GEN_BOOST`` makes ``</s>`` likely after a few tokens,
    and ``generate`` runs with several num_beams / length_penalty / early_stopping settings on a batch of 4
    right-padded sources. Only ``expected.npz`` (``src``, ``src_lengths``, ``seq{i}``) and ``meta.json``
    (the cases); the checkpoint is ``../marian``."""
    import torch
    import transformers
    from transformers import MarianMTModel

    if not (src / "config.json").exists():
        raise SystemExit("marian_generate needs the marian fixture first (run with --only marian,marian_generate)")
    model = MarianMTModel.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).eval()
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    with torch.no_grad():
        model.final_logits_bias[0, eos] += MARIAN_GEN_BOOST
    gen = torch.Generator().manual_seed(7)
    B, S = 4, 11
    src_ids = torch.randint(2, pad, (B, S), generator=gen)
    lengths = torch.tensor([11, 7, 4, 9])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    for b in range(B):
        src_ids[b, lengths[b] - 1] = eos
        src_ids[b, lengths[b]:] = pad
    arrays = {"src": src_ids.numpy(), "src_lengths": lengths.numpy()}
    cases = []
    for i, (nb, lp, es) in enumerate(MARIAN_GEN_CASES):
        with torch.no_grad():
            seq = model.generate(src_ids, attention_mask=mask, num_beams=nb, do_sample=False,
                                 max_new_tokens=MARIAN_GEN_NEW, length_penalty=lp, early_stopping=es)
        arrays[f"seq{i}"] = seq.numpy().astype(np.int64)
        cases.append(dict(name=f"seq{i}", num_beams=nb, length_penalty=lp, early_stopping=es,
                          max_new_tokens=MARIAN_GEN_NEW))
        ends = [int(np.flatnonzero(r[1:] == eos)[0]) + 1 for r in seq.numpy()]
        print(f"    seq{i} beams {nb} length_penalty {lp} early_stopping {es}: generated lengths {ends}")
    save_npz(out / "expected.npz", arrays)
    write_json(out / "meta.json", {
        "name": "marian_generate", "family": "marian",
        "checkpoint": "../marian, with final_logits_bias[eos] += boost before generating",
        "boost": MARIAN_GEN_BOOST, "eos_token_id": eos, "pad_token_id": pad, "cases": cases,
        "call": "model.generate(src, attention_mask=(positions < src_lengths), num_beams=, do_sample=False, "
                "max_new_tokens=, length_penalty=, early_stopping=); generation_config.json of ../marian "
                "(bad_words_ids [[pad]], forced_eos_token_id eos)",
        "transformers_version": transformers.__version__, "torch_version": torch.__version__.split("+")[0],
    })


# ----------------------------------------------------------------------------------------------------------

FIXTURES = {
    "gpt2": make_gpt2,
    "llama": make_llama,
    "llama3": make_llama3,
    "llama3_legacy": None,   # derived from llama3
    "qwen2": make_qwen2,
    "mistral": make_mistral,
    "bert": make_bert,
    "bloom": make_bloom,
    "bloom_6heads": make_bloom_6heads,
    "marian": make_marian,
    "marian_generate": None,  # derived from marian
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "fixtures"))
    ap.add_argument("--only", default="", help="comma-separated fixture names (default: all): " + ",".join(FIXTURES))
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FIXTURES)
    bad = [n for n in names if n not in FIXTURES]
    if bad:
        ap.error(f"unknown fixture(s) {bad}; choose from {list(FIXTURES)}")

    import torch
    import transformers

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, out={args.out}")
    root = Path(args.out)
    for name, make in FIXTURES.items():          # fixed order: llama3 before llama3_legacy
        if name not in names:
            continue
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        print(f"[{name}]")
        if name == "llama3_legacy":
            make_llama3_legacy(out, root / "llama3")
        elif name == "marian_generate":
            make_marian_generate(out, root / "marian")
        else:
            make(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
