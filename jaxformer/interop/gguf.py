"""GGUF files in (llama.cpp's format): ``load_pretrained("model.gguf")`` and ``load_tokenizer("model.gguf")``.

::

    config, graphdef, state = load_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")   # de-quantized, float32
    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")                           # tokenizer.ggml.*
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

A GGUF file is one file: metadata under llama.cpp's key names (``llama.block_count``...), the tokenizer
(``tokenizer.ggml.*``, ``tokenizer.chat_template``) and the tensors (``blk.{i}.attn_q.weight``...), float or
quantized in blocks. It is read with the ``gguf`` library llama.cpp publishes and de-quantized by its own
``gguf.quants`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K and the I-quants: every type it
implements). Nothing here is a second loader: :func:`hf_config` turns the metadata into the ``config.json``
dict the Llama family reads, and :class:`GGUFTensors` shows the tensors under their Hugging Face names,
de-quantized to float32, so :func:`jaxformer.interop.hf.load_pretrained` checks every shape against the
config before reading a byte and loads them with the same rules as a safetensors checkpoint.

Architectures (``general.architecture``): ``llama``, ``qwen2`` (q/k/v biases) and ``mistral``. llama.cpp's
converter writes Llama *and* Mistral checkpoints as ``llama``; it never writes a sliding window for
them, and llama.cpp computes full attention, so ``llama`` is always read as Llama (transformers renames a
``llama`` file whose ``general.name`` contains "mistral" to Mistral with its 4096-token default window:
the same logits below 4096 tokens). ``mistral`` (which llama.cpp does not write) slides only over
``mistral.attention.sliding_window``, when the file says so. Anything the metadata cannot say exactly
is an :class:`HFConfigError` naming the file and key (or tensor): another architecture, a key of the
architecture this module does not map (a MoE's ``expert_count``, a sliding window, YaRN RoPE scaling,
Llama 3.1's ``rope_freqs.weight`` frequency factors). A bad file is an :class:`HFWeightsError` naming
the file and tensor: truncated, an unknown type id, a type ``gguf.quants`` cannot de-quantize, a tensor
missing or of the wrong shape.

**The Q/K permutation.** llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
stores the rows of ``W_q`` / ``W_k`` (and their biases) of ``llama`` models in the interleaved-pair
RoPE layout of Meta's original checkpoints: per head, rows ``[x_0..x_{H/2-1} | y_0..y_{H/2-1}]`` (HF's
``rotate_half`` halves) become ``[x_0, y_0, x_1, y_1, ...]``; ``permute(w) = w.reshape(n_head, 2, H/2,
...).swapaxes(1, 2)``, with ``n_head`` the query heads for ``W_q`` and the kv heads for ``W_k``.
:func:`unpermute_qk` undoes it for ``llama`` only, as transformers' GGUF loader does (its
``LlamaTensorProcessor``); llama.cpp's ``Qwen2Model`` converter does not permute (NeoX RoPE), and
transformers reads ``qwen2`` and ``mistral`` files unchanged.

**Tokenizer** (:func:`gguf_tokenizer_fields`, through ``tokenizers``): ``tokenizer.ggml.model`` ``gpt2``
(byte-level BPE with the file's merges; the split regex chosen by ``tokenizer.ggml.pre`` from
:data:`PRE_TOKENIZER_SPLITS`) or ``llama`` (SentencePiece-style BPE with byte fallback, merges from the
file or rebuilt from the token scores as transformers rebuilds them); control tokens are special,
user-defined ones added whole; BOS / EOS added per ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``;
the chat template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.interop.byte_level import byte_unicode_table
from jaxformer.interop.rules import HFConfigError, HFWeightsError

SUFFIX = ".gguf"
MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "mistral", "qwen2")
PERMUTED = ("llama",)  # architectures whose W_q / W_k rows llama.cpp's converter permuted (transformers agrees)
FLOAT_TYPES = ("F32", "F16", "BF16")  # read as themselves; every other type is de-quantized to float32

# {arch}.<key> this module reads (anything else under the architecture's prefix is refused, naming the key)
ARCH_KEYS = (
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scale_linear",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",
)

# GGUF tensor names -> Hugging Face names (llama.cpp's gguf-py tensor_mapping for these architectures)
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)")

# tokenizer.ggml.pre -> the split regex of byte-level BPE (None: GPT-2's, the `ByteLevel` pre-tokenizer's own).
# `smollm` (SmolLM / SmolLM2): llama.cpp splits every digit apart first, then GPT-2's regex; the file does not
# carry the regex, and transformers' GGUF loader uses GPT-2's regex alone. This vocabulary has no merge
# joining digits, so the two differ only where whitespace runs into a number ("a  12": GPT-2's regex gives
# `a`, ` `, ` 12` -> [a, Ġ, Ġ, 1, 2]; digits-first gives `a  `, `1`, `2` -> [a, ĠĠ, 1, 2]). GPT-2's regex is
# used: it reproduces transformers' ids on every fixture prompt (tests/interop/test_gguf.py), the digits-first
# rule does not on the one with two spaces before a number.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2_SPLIT, "gpt-2": _GPT2_SPLIT, "gpt2": _GPT2_SPLIT, "smollm": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name (existing or not), or a file starting with ``GGUF``."""
    path = Path(path)
    if path.suffix.lower() == SUFFIX:
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


# -- the file

class GGUFFile:
    """One GGUF file read with ``gguf.GGUFReader`` (memory-mapped): typed metadata access naming the key."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = _read(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._values: dict[str, Any] = {}

    def keys(self) -> list[str]:
        return list(self.reader.fields)

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self.path}: {key}: {message}")

    def get(self, key: str, default: Any = None, types: type | tuple[type, ...] | None = None) -> Any:
        if key not in self.reader.fields:
            return default
        if key not in self._values:
            self._values[key] = self.reader.fields[key].contents()
        value = self._values[key]
        if types is not None:
            allowed = types if isinstance(types, tuple) else (types,)
            if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
                raise self.error(key, f"expected {' or '.join(t.__name__ for t in allowed)}, got {value!r}")
        return value

    def need(self, key: str, types: type | tuple[type, ...] | None = None) -> Any:
        if key not in self.reader.fields:
            raise self.error(key, "missing (required for this architecture)")
        return self.get(key, types=types)


def _read(path: Path):
    """``gguf.GGUFReader(path)``, with each tensor's type and extent checked first, so a bad file is an error
    naming the tensor (the reader itself raises a bare enum or reshape error)."""
    import gguf

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise HFWeightsError(f"{path}: not a GGUF file (starts with {head!r}, a GGUF file with {MAGIC!r})")

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._bytes

        @data.setter
        def data(self, mapped):  # the reader's np.memmap, kept as a plain ndarray view of the same mapping: the
            # header's ~250k small reads (a 49k-token vocabulary) cost 3x as much through memmap's subclass hooks
            self._bytes = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

        def _build_tensors(self, start_offs, fields):
            for field in fields:  # the parts GGUFReader._build_tensors unpacks, in its order
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise _Bad(f"tensor {name}: type id {int(raw_type[0])} is not a GGML type gguf "
                               f"{_version()} knows") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                shape = [int(d) for d in dims]  # innermost first
                end = int(start_offs) + int(offset[0]) + int(np.prod(shape)) // block * type_size
                if shape and shape[0] % block or end > size:
                    why = (f"rows of {shape[0]} are not whole {qtype.name} blocks of {block}" if end <= size else
                           f"its {qtype.name} data ends at byte {end}, the file has {size} (truncated?)")
                    raise _Bad(f"tensor {name}: {why}")
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(str(path))
    except _Bad as e:
        raise HFWeightsError(f"{path}: {e}") from None
    except Exception as e:  # the header itself cut short or corrupt: the reader fails on a short read
        raise HFWeightsError(f"{path}: cannot read the GGUF header ({type(e).__name__}: {e}); "
                             f"the file ({size} bytes) is truncated or corrupt") from None


class _Bad(Exception):
    pass


def _version() -> str:
    from importlib.metadata import version

    return version("gguf")


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, stamp: tuple) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, cached: parsing a 49k-token vocabulary's header takes over a second, and one load reads
    the config, the tensors and the tokenizer. The cache key is the path, inode, size, modification time
    and a hash of the first and last 256 KiB (the metadata is at the start), so a file rewritten in place
    within one clock tick is still read afresh."""
    import hashlib

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    st = path.stat()
    with open(path, "rb") as f:
        head = f.read(1 << 18)
        f.seek(max(st.st_size - (1 << 18), len(head)))
        digest = hashlib.blake2b(head + f.read(), digest_size=16).hexdigest()
    return _open_cached(str(path.resolve()), (st.st_ino, st.st_size, st.st_mtime_ns, digest))


# -- metadata -> config.json

def _int_per_layer(g: GGUFFile, key: str, default: Any = None) -> int | None:
    """An int key some files store per layer (an array): one value, or an error naming the key."""
    value = g.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise g.error(key, f"{value}: a different value per layer is not supported")
        value = value[0]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise g.error(key, f"expected an integer, got {value!r}")
    return value


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The file's metadata as the ``config.json`` dict of the Llama family (:mod:`jaxformer.interop.llama`)."""
    arch = g.need("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise g.error("general.architecture", f"{arch!r} is not supported (supported: {list(ARCHITECTURES)})")
    kind = g.get("general.type", "model", str)
    if kind != "model":
        raise g.error("general.type", f"{kind!r}: not a model file (an adapter or projector is not read here)")
    if g.get("split.count", 1, int) > 1:
        raise g.error("split.count", f"{g.get('split.count')}: one shard of a split GGUF; merge the shards first "
                                     "(llama-gguf-split --merge)")
    unknown = [k for k in g.keys() if k.startswith(arch + ".") and k[len(arch) + 1:] not in ARCH_KEYS]
    if unknown:
        raise g.error(unknown[0], "not supported (a key jaxformer does not map, so it cannot tell whether the "
                                  f"model computes what the file means; all such keys: {unknown})")
    if "rope_freqs.weight" in g.tensors:
        raise HFConfigError(f"{g.path}: tensor rope_freqs.weight: per-frequency RoPE factors (how llama.cpp stores "
                            "Llama 3.1-style rope scaling, without its parameters) are not supported")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    D = g.need(key("embedding_length"), int)
    N = _int_per_layer(g, key("attention.head_count"))
    if N is None:
        raise g.error(key("attention.head_count"), "missing (required for this architecture)")
    K = _int_per_layer(g, key("attention.head_count_kv"), N)
    F = _int_per_layer(g, key("feed_forward_length"))
    if F is None:
        raise g.error(key("feed_forward_length"), "missing (required for this architecture)")
    if g.get(key("expert_count"), 0, int) > 0:
        raise g.error(key("expert_count"), f"{g.get(key('expert_count'))}: mixture-of-experts is not supported")
    head_dim = g.get(key("attention.key_length"), types=int)
    rotary = g.get(key("rope.dimension_count"), types=int)
    head_dim = head_dim or D // N  # llama.cpp: key_length, else D / N; rope.dimension_count is the rotated part
    if g.get(key("attention.value_length"), head_dim, int) != head_dim:
        raise g.error(key("attention.value_length"), f"{g.get(key('attention.value_length'))} differs from the "
                                                     f"key length {head_dim} (not supported)")
    if rotary is not None and rotary != head_dim:
        raise g.error(key("rope.dimension_count"), f"{rotary}: RoPE on part of the {head_dim}-dim head is not "
                                                   "supported")
    window = g.get(key("attention.sliding_window"), types=int)
    if window is not None and arch != "mistral":
        raise g.error(key("attention.sliding_window"), f"{window}: a sliding window in a {arch} file is not "
                                                       "supported (which layers slide is not in the file)")
    hf: dict[str, Any] = dict(
        model_type=arch, hidden_size=D, num_attention_heads=N, num_key_value_heads=K, head_dim=head_dim,
        num_hidden_layers=g.need(key("block_count"), int), intermediate_size=F,
        rms_norm_eps=float(g.need(key("attention.layer_norm_rms_epsilon"), (int, float))),
        rope_theta=float(g.get(key("rope.freq_base"), 10000.0, (int, float))), rope_scaling=_rope_scaling(g, arch),
        max_position_embeddings=g.need(key("context_length"), int), hidden_act="silu",
        vocab_size=g.get(key("vocab_size"), types=int) or len(g.get("tokenizer.ggml.tokens", [])) or
        _rows(g, "token_embd.weight"),
        tie_word_embeddings="output.weight" not in g.tensors,  # llama.cpp writes the head only when untied
    )
    if arch == "mistral":
        hf["sliding_window"] = window
    for ours, theirs in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{theirs}_token_id" in g.reader.fields:
            hf[f"{ours}_token_id"] = g.get(f"tokenizer.ggml.{theirs}_token_id", types=int)
    return hf


def _rows(g: GGUFFile, name: str) -> int | None:
    t = g.tensors.get(name)
    return None if t is None else int(t.shape[-1])


def _rope_scaling(g: GGUFFile, arch: str) -> dict | None:
    kind = g.get(f"{arch}.rope.scaling.type", types=str)
    legacy = g.get(f"{arch}.rope.scale_linear", types=(int, float))
    if kind in (None, "none") and legacy is None:
        return None
    if kind not in (None, "none", "linear"):
        raise g.error(f"{arch}.rope.scaling.type", f"{kind!r} is not supported (supported: none, linear)")
    factor = g.get(f"{arch}.rope.scaling.factor", legacy, (int, float))
    if factor is None:
        raise g.error(f"{arch}.rope.scaling.factor", "missing (required for linear rope scaling)")
    return {"rope_type": "linear", "factor": float(factor)}


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's metadata as a ``config.json`` dict (what :func:`jaxformer.interop.hf.read_config` returns)."""
    return hf_config(open_gguf(path))


# -- tensors under Hugging Face names

def hf_name(name: str) -> str:
    """A GGUF tensor name as Hugging Face spells it (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); a name with no counterpart is returned as it is."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return name
    if base in TOP_TENSORS:
        return f"{TOP_TENSORS[base]}.{suffix}"
    m = _LAYER.fullmatch(base)
    if m and m[2] in LAYER_TENSORS:
        return f"model.layers.{m[1]}.{LAYER_TENSORS[m[2]]}.{suffix}"
    return name


def gguf_name(name: str) -> str:
    """:func:`hf_name`'s inverse (``model.layers.1.mlp.up_proj.weight`` -> ``blk.1.ffn_up.weight``)."""
    base, _, suffix = name.rpartition(".")
    top = {hf: g for g, hf in TOP_TENSORS.items()}
    if base in top:
        return f"{top[base]}.{suffix}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    layer = {hf: g for g, hf in LAYER_TENSORS.items()}
    if m and m[2] in layer:
        return f"blk.{m[1]}.{layer[m[2]]}.{suffix}"
    return name


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute`` of ``W_q`` / ``W_k`` rows (or a bias): ``[n_head * H, ...]``.

    ``permute(w) = w.reshape(n_head, 2, H/2, ...).swapaxes(1, 2).reshape(w.shape)``; this is its
    inverse, ``w.reshape(n_head, H/2, 2, ...).swapaxes(1, 2).reshape(w.shape)``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{w.shape=}: rows {rows} are not n_head={n_head} heads of an even head dim")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def dequantizable(type_name: str) -> bool:
    """Whether ``gguf.quants.dequantize`` implements this GGML type (tried on one block of zeros)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in FLOAT_TYPES:
        return True
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, de-quantized on read (the interface
    :func:`jaxformer.interop.hf.load_pretrained` reads a checkpoint through: ``where``, ``shape``,
    ``dtype``, ``read``). ``shape`` is in numpy / torch order (GGUF lists dims innermost first);
    ``dtype`` is the float type :meth:`read` returns (float32 for every quantized type)."""

    def __init__(self, g: GGUFFile):
        hf = hf_config(g)
        self.path = g.path
        self._permute = hf["model_type"] in PERMUTED
        self._heads = {"self_attn.q_proj": hf["num_attention_heads"], "self_attn.k_proj": hf["num_key_value_heads"]}
        self.where: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        self._source: dict[str, Any] = {}
        unsupported = []
        for t in g.reader.tensors:
            name = hf_name(t.name)
            kind = t.tensor_type.name
            if not dequantizable(kind):
                unsupported.append(f"{t.name} ({kind})")
            self.where[name] = f"{g.path.name}:{t.name}"
            self.shape[name] = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.dtype[name] = kind if kind in FLOAT_TYPES else "F32"
            self._source[name] = t
        if unsupported:
            supported = [t for t in _type_names() if dequantizable(t)]
            raise HFWeightsError(f"{g.path}: tensor {unsupported[0]}: a type gguf.quants cannot de-quantize (all "
                                 f"such tensors: {unsupported}; supported: {supported})")

    def file_name(self, name: str) -> str:
        """The GGUF name of a Hugging Face tensor name (``model.layers.1.mlp.up_proj.weight`` ->
        ``blk.1.ffn_up.weight``), for error messages; a name with no GGUF counterpart as it is."""
        return self._source[name].name if name in self._source else gguf_name(name)

    def read(self, name: str) -> np.ndarray:
        import gguf

        t = self._source[name]
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(self.shape[name])
        if self._permute:
            for proj, n_head in self._heads.items():
                if name.startswith("model.layers.") and name.rsplit(".", 1)[0].endswith(proj):
                    a = unpermute_qk(a, n_head)
        return a


def _type_names() -> list[str]:
    import gguf

    return [t.name for t in gguf.GGMLQuantizationType]


def open_tensors(path: str | os.PathLike) -> GGUFTensors:
    return GGUFTensors(open_gguf(path))


# -- tokenizer

def generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary with scores (a file without ``tokenizer.ggml.merges``):
    every split of a piece into two pieces of the vocabulary, best score first, as transformers rebuilds them."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def gguf_tokenizer_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer a GGUF file describes, as the keyword arguments of
    :class:`jaxformer.interop.tokenizer.HFTokenizer` (``load_tokenizer`` builds it; this module never imports
    that one, which dispatches a ``.gguf`` path here)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    g = open_gguf(path)
    kind = g.need("tokenizer.ggml.model", str)
    tokens = g.need("tokenizer.ggml.tokens", list)
    types = g.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens), list)
    if len(types) != len(tokens):
        raise g.error("tokenizer.ggml.token_type", f"{len(types)} types for {len(tokens)} tokens")
    merges = g.get("tokenizer.ggml.merges", types=list)
    merges = None if merges is None else [tuple(m.split(" ", 1)) for m in merges]
    if kind == "gpt2":
        spelling = byte_unicode_table()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        if merges is None:
            raise g.error("tokenizer.ggml.merges", "missing (byte-level BPE needs its merges)")
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
        pre = g.get("tokenizer.ggml.pre", "default", str)
        if pre not in PRE_TOKENIZER_SPLITS:
            raise g.error("tokenizer.ggml.pre", f"{pre!r}: no split rule known for this pre-tokenizer "
                                                f"(supported: {sorted(PRE_TOKENIZER_SPLITS)})")
        split = PRE_TOKENIZER_SPLITS[pre]
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges is None:
            scores = g.need("tokenizer.ggml.scores", list)
            if len(scores) != len(tokens):
                raise g.error("tokenizer.ggml.scores", f"{len(scores)} scores for {len(tokens)} tokens")
            merges = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
        unk = g.get("tokenizer.ggml.unknown_token_id", types=int)
        unk = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
        # a character with no piece and no <0xNN> byte piece becomes <unk> (transformers' GGUF reader drops it)
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None, unk_token=unk))
        prefix = g.get("tokenizer.ggml.add_space_prefix", True, bool)
        scheme = "first" if prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True  # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary by default
    else:
        raise g.error("tokenizer.ggml.model", f"{kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
                                              "'llama' SentencePiece-style BPE)")
    ids = {k: g.get(f"tokenizer.ggml.{k}_token_id", types=int) for k in ("bos", "eos", "unknown", "padding")}
    for k, i in ids.items():
        if i is not None and not 0 <= i < len(tokens):
            raise g.error(f"tokenizer.ggml.{k}_token_id", f"{i} is not a token id (vocabulary of {len(tokens)})")
    specials = {ours: None if ids[theirs] is None else tokens[ids[theirs]]
                for ours, theirs in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    spelled = set(byte_unicode_table().values()) if kind == "gpt2" else None
    # a control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it too)
    control = [t for t, k in zip(tokens, types, strict=True)
               if k == TOKEN_CONTROL and (spelled is None or set(t) <= spelled)]
    named = [t for t in specials.values() if t is not None and t not in control]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control + named])
    user = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    add = [(specials["bos"], ids["bos"]) if g.get("tokenizer.ggml.add_bos_token", add_bos_default, bool) else None,
           (specials["eos"], ids["eos"]) if g.get("tokenizer.ggml.add_eos_token", False, bool) else None]
    for key, pair in zip(("add_bos_token", "add_eos_token"), add, strict=True):
        if pair is not None and pair[0] is None:
            raise g.error(f"tokenizer.ggml.{key}", f"true, but the file has no {key[4:7]}_token_id")
    bos, eos = add
    if bos or eos:
        single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
        pair = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []) +
                        ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=sorted({p for p in add if p}))
    special_ids = {i for i, k in enumerate(types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
    special_ids |= {i for i in ids.values() if i is not None}
    return dict(
        path=g.path, vocab=tok.get_vocab(with_added_tokens=True), specials=specials,
        codec=(lambda s: tok.encode(s, add_special_tokens=False).ids,  # a Codec's encode, decode, prompt
               lambda i: tok.decode(i, skip_special_tokens=True),
               lambda s: tok.encode(s, add_special_tokens=True).ids),
        byte_level=kind == "gpt2", special_ids=special_ids,
        chat_template=g.get("tokenizer.chat_template", types=str))
