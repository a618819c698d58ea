"""How one Hugging Face family maps onto jaxformer: a config translation and a list of tensor rules.

A :class:`Rule` ties one or more HF tensors to one or more jaxformer parameters,
with a ``load`` function (HF arrays -> jaxformer arrays, numpy in and out) and its
inverse ``save``. Most rules are one torch ``nn.Linear`` weight ``[out, in]`` to one
jaxformer kernel ``[in, ...]`` (:func:`linear`); fused projections (GPT-2's
``c_attn``, BLOOM's ``query_key_value``) are one HF tensor to three parameters.
The loader never trusts either side's shapes: it derives the HF shapes a config
implies by running ``save`` on the jaxformer shapes (``jax.eval_shape``) and
checks every header against them before it reads a byte.

A :class:`Family` (one per module: ``gpt2``, ``llama``, ``bert``, ``bloom``,
``marian``) says which ``model_type`` values it reads, turns ``config.json``
into a :class:`~jaxformer.model.ModelConfig` (refusing, with the key's name,
anything it cannot reproduce exactly) and back, and lists its rules.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxformer.model.config import ModelConfig, get_key

Path_ = tuple[str | int, ...]  # a parameter's path in the nnx.State, e.g. ("decoder", "blocks", 0, "mlp", "w_in")


class HFConfigError(ValueError):
    """A ``config.json`` the loader cannot reproduce exactly; the message names the file and key."""


class HFWeightsError(ValueError):
    """Missing, unexpected or mis-shaped tensors; the message names the tensors and files."""


def read_json_object(file, error: type[Exception] = HFConfigError) -> dict:
    """The JSON object in ``file`` (a ``config.json``, an ``adapter_config.json``): ``error`` naming the file
    when it is not valid JSON or not an object (a missing file is the caller's to name)."""
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF tensors ``hf`` <-> jaxformer parameters ``jax``.

    ``load(*hf_arrays) -> tuple of jax arrays`` (one per ``jax`` path) and
    ``save(*jax_arrays) -> tuple of hf arrays`` (one per ``hf`` name), inverse
    of each other; both must work on numpy arrays and under ``jax.eval_shape``
    (use ``.T``, ``.reshape``, slicing and ``concatenate`` via the array's own
    namespace: see :func:`xp`).
    """

    hf: tuple[str, ...]
    jax: tuple[Path_, ...]
    load: Callable[..., tuple]
    save: Callable[..., tuple]


def xp(a):
    """The array namespace of ``a``: numpy for numpy arrays, jax.numpy otherwise (tracers, ShapeDtypeStruct)."""
    if isinstance(a, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def same(hf: str, path: Path_) -> Rule:
    """The same array on both sides (embeddings, norm scales, biases of shape [D])."""
    return Rule((hf,), (path,), lambda a: (a,), lambda a: (a,))


def reshaped(hf: str, path: Path_, shape: Sequence[int]) -> Rule:
    """A flat HF vector (e.g. a q bias ``[N*H]``) <-> a jaxformer ``shape`` (``[N, H]``)."""
    shape = tuple(shape)
    return Rule((hf,), (path,), lambda a: (a.reshape(shape),), lambda a: (a.reshape(-1),))


def linear(hf: str, path: Path_, in_shape: Sequence[int], out_shape: Sequence[int]) -> Rule:
    """A torch ``nn.Linear`` weight ``[out, in]`` <-> a jaxformer kernel ``[*in_shape, *out_shape]``.

    E.g. W_q: ``[N*H, D]`` <-> ``[D, N, H]`` (``in_shape=(D,)``, ``out_shape=(N, H)``); W_o:
    ``[D, N*H]`` <-> ``[N, H, D]`` (``in_shape=(N, H)``, ``out_shape=(D,)``).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    n_in = int(np.prod(in_shape))

    def load(w):
        return (w.T.reshape(in_shape + out_shape),)

    def save(k):
        return (k.reshape(n_in, -1).T,)

    return Rule((hf,), (path,), load, save)


def conv1d(hf: str, path: Path_, in_shape: Sequence[int], out_shape: Sequence[int]) -> Rule:
    """GPT-2's ``Conv1D`` weight ``[in, out]`` (already x @ W) <-> a kernel ``[*in_shape, *out_shape]``."""
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    n_in = int(np.prod(in_shape))
    return Rule((hf,), (path,), lambda w: (w.reshape(in_shape + out_shape),),
                lambda k: (k.reshape(n_in, -1),))


def transposed(hf: str, path: Path_) -> Rule:
    """A 2-D HF weight ``[a, b]`` <-> a jaxformer ``[b, a]`` (an untied LM head: ``[V, D]`` <-> ``[D, V]``)."""
    return Rule((hf,), (path,), lambda w: (w.T,), lambda k: (k.T,))


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF family. Subclass per module; the loader uses only these members.

    Attributes:
      name: the family's short name (``gpt2``, ``llama``, ...).
      model_types: ``config.json`` ``model_type`` values it reads.
      prefixes: name prefixes a checkpoint may put before every tensor (e.g. ``"model."`` for
        ``LlamaForCausalLM``, ``""`` for a bare ``LlamaModel``); the first is what ``save`` writes.
      ignore: prefixes of HF tensors the loader skips: buffers some versions save (recomputed here, e.g.
        RoPE's ``inv_freq``) and heads it does not model, each named in the family's module docstring.
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ("",)
    ignore: tuple[str, ...] = ()

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        """``config.json`` content (``model_type``, ``architectures`` and every field HF needs)."""
        raise NotImplementedError

    def rules(self, config: ModelConfig) -> list[Rule]:
        raise NotImplementedError

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        """Prefixes of HF tensors to skip for this config (default: :attr:`ignore`), e.g. a tied
        model's ``lm_head.weight`` some checkpoints store anyway."""
        return self.ignore

    def rename(self, name: str) -> str:
        """A checkpoint's tensor name as this family's rules spell it (default: unchanged), for names
        older exporters wrote differently (BERT's ``LayerNorm.gamma`` / ``.beta``)."""
        return name

    def tied_copies(self, config: ModelConfig) -> dict[str, str]:
        """``{copy: source}``: tensors a checkpoint may store although this config ties them (a tied head's
        ``lm_head.weight``); the loader requires each stored copy to equal its source, since transformers
        would use a stored copy that differs, and jaxformer reads only the source."""
        return {}

    def optional(self, config: ModelConfig) -> tuple[str, ...]:
        """HF tensor names (after the prefix) a checkpoint may omit, e.g. ``lm_head.weight`` of a tied
        head; the loader fills them from the rule's other sources (see :meth:`fill`)."""
        return ()

    def fill(self, name: str, present: Mapping[str, np.ndarray]) -> np.ndarray:
        raise HFWeightsError(f"{name} is missing")

    def verify(self, config: ModelConfig, present: Mapping[str, np.ndarray]) -> None:
        """Check tensors no rule loads but the model must agree with (a fixed position table, a tied copy
        some checkpoints store); raise :class:`HFWeightsError`. ``present``: the checkpoint's tensors by
        canonical name, read on access. Runs after the header checks, before any parameter is read."""

    def hf_defaults(self, config: ModelConfig) -> dict[str, Any]:
        """``config.json`` keys ``save_pretrained`` writes unless ``hf_config`` gives them (e.g. token ids
        transformers needs to build the model: Marian's ``pad_token_id``)."""
        return {}


class Reader:
    """Typed access to a ``config.json`` dict that names the file and key in every error."""

    def __init__(self, hf: Mapping[str, Any], where: str):
        self.hf, self.where = hf, where

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self.where}: {key}: {message}")

    def get(self, key: str, default: Any = None, *, types: type | tuple[type, ...] | None = None) -> Any:
        value = self.hf.get(key, default)
        if types is not None and value is not None and not isinstance(value, types):
            raise self.error(key, f"expected {types}, got {value!r}")
        return value

    def need(self, key: str, types: type | tuple[type, ...] | None = None) -> Any:
        if key not in self.hf or self.hf[key] is None:
            raise self.error(key, "missing (required for this model_type)")
        return self.get(key, types=types)

    def first(self, *keys: str, default: Any = None) -> Any:
        """The first of ``keys`` present (HF renamed several keys over the years)."""
        for key in keys:
            if self.hf.get(key) is not None:
                return self.hf[key]
        return default

    def expect(self, key: str, allowed: Sequence[Any], default: Any = None) -> Any:
        """``hf[key]`` (or ``default``) if it is one of ``allowed``; an error naming the key otherwise."""
        value = self.hf.get(key, default)
        if value not in allowed:
            raise self.error(key, f"{value!r} is not supported (supported: {list(allowed)})")
        return value


ACTIVATIONS_FROM_HF = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": None,
    "relu": "relu", "silu": "silu", "swish": "silu",
}


def mha_problems(c: ModelConfig) -> list[str]:
    """The export refusal of a config whose attention is not multi-head with ``head_dim = d_model / n_heads``
    (what GPT-2, BLOOM, BERT and Marian store); empty when it is."""
    if c.resolved_kv_heads == c.attention.n_heads and c.resolved_head_dim * c.attention.n_heads == c.d_model:
        return []
    return [f"attention.n_kv_heads={c.attention.n_kv_heads}, attention.head_dim={c.attention.head_dim} "
            "(needs MHA with head_dim = D / N)"]


def set_options(c: ModelConfig, keys: Sequence[str]) -> list[str]:
    """``key=value`` for each of ``keys`` (a top-level field or ``section.field``) that ``c`` sets to other
    than None or False: options a family's ``config.json`` cannot hold."""
    return [f"{k}={get_key(c, k)!r}" for k in keys if get_key(c, k) not in (None, False)]


def activation_from_hf(r: Reader, key: str, default: str, *, gated: bool = False) -> str:
    """jaxformer's activation for an HF ``hidden_act`` / ``activation_function`` value."""
    value = r.get(key, default)
    ours = ACTIVATIONS_FROM_HF.get(value)
    if ours is None:
        raise r.error(key, f"{value!r} is not supported (supported: "
                           f"{sorted(k for k, v in ACTIVATIONS_FROM_HF.items() if v)})")
    if gated:
        glu = {"silu": "swiglu", "gelu": "geglu"}.get(ours)
        if glu is None:
            raise r.error(key, f"{value!r} in a gated MLP is not supported (silu -> swiglu, gelu -> geglu)")
        return glu
    return ours


ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
