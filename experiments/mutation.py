"""Mutation check: seed realistic bugs into a copy of the library, one at a time, and see whether the tests
of the default test command catch each.

    .venv/bin/python experiments/mutation.py                 # every mutation, a table at the end
    .venv/bin/python experiments/mutation.py --only rope_exponent causal_lt
    .venv/bin/python experiments/mutation.py --list
    .venv/bin/python experiments/mutation.py --out experiments/results/mutation.md

Each mutation is one exact text replacement (it must match exactly once, so a refactor that moves the
code makes the harness say so instead of silently testing nothing). The library, the kernels and the
tests are copied to a temporary directory; the mutated copy is imported first (PYTHONPATH), and the
mutation's test files run there under the default profile and markers (``-m 'not slow'``), stopping at
the first failure. A baseline run of every listed test file on the unmutated copy must pass first.
Run it when a test or the code it guards changes; the table goes in the issue note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("jaxformer", "pallas_kernels", "tests", "pyproject.toml", "experiments/bench")  # bench: the scripts tests import


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


ATTN = ("tests/ops/test_attention.py", "tests/ops/test_attention_impls.py")
MODEL = ("tests/model/test_oracle.py", "tests/model/test_transformer.py")

HF = "tests/interop/"
GGUF = HF + "test_gguf.py"

MUTATIONS = [
    # -- Hugging Face interop: the layouts, the config translation and the model options it needs
    Mutation("hf_linear_not_transposed", "jaxformer/interop/rules.py",
             "return (w.T.reshape(in_shape + out_shape),)", "return (w.reshape(in_shape + out_shape),)",
             (HF + "test_llama.py",), "torch Linear [out, in] read without the transpose (square W_q passes shapes)"),
    Mutation("hf_llama3_original_context", "jaxformer/interop/llama.py",
             '("original_max_position", "original_max_position_embeddings")',
             '("original_max_position", "max_position_embeddings")',
             (HF + "test_llama.py",), "Llama 3 scaling reads max_position_embeddings as the original context"),
    Mutation("hf_window_off_by_one", "jaxformer/interop/llama.py",
             "sparsity=dict(window=None if window is None else (window - 1, 0)),",
             "sparsity=dict(window=None if window is None else (window, 0)),",
             (HF + "test_llama.py",), "Mistral sliding_window W read as W + 1 positions"),
    Mutation("hf_gpt2_split_kq", "jaxformer/interop/gpt2.py",
             "return tuple(w[:, j * N * H:(j + 1) * N * H].reshape(D, N, H) for j in range(3))",
             "return tuple(w[:, j * N * H:(j + 1) * N * H].reshape(D, N, H) for j in (1, 0, 2))",
             (HF + "test_gpt2.py",), "GPT-2 c_attn columns split as [k | q | v]"),
    Mutation("hf_bloom_qkv_blocks", "jaxformer/interop/bloom.py",
             "w = w.reshape(N, 3, H, D)\n        return tuple(w[:, j].transpose(2, 0, 1) for j in range(3))",
             "w = w.reshape(3, N, H, D)\n        return tuple(w[j].transpose(2, 0, 1) for j in range(3))",
             (HF + "test_bloom.py",), "BLOOM query_key_value read as [3, N, H] blocks instead of per head [N, 3, H]"),
    Mutation("hf_marian_interleaved", "jaxformer/interop/marian.py",
             'positions=dict(kind="sinusoidal", sinusoidal_layout="halves")',
             'positions=dict(kind="sinusoidal", sinusoidal_layout="interleaved")',
             (HF + "test_marian.py",), "Marian's [sin | cos] position table read as interleaved"),
    Mutation("logits_bias_dropped", "jaxformer/model/transformer.py",
             "out = add_bias(out, self.logits_bias, jnp.float32)", "out = add_bias(out, None, jnp.float32)",
             (HF + "test_marian.py", HF + "test_bert.py"), "head_bias built and loaded but never added"),
    Mutation("token_types_ignored", "jaxformer/model/transformer.py",
             "x = x + self.type_embed(jnp.zeros_like(tokens) if token_types is None else token_types)",
             "x = x + self.type_embed(jnp.zeros_like(tokens))",
             (HF + "test_bert.py",), "BERT token_type_ids ignored (always segment 0)"),
    Mutation("kv_cache_window_ignored", "jaxformer/decode/kv_cache.py",
             "band = None if self.window is None else (self.window - 1, 0)", "band = None",
             (HF + "test_llama.py", "tests/decode/test_kv_cache.py"), "the contiguous cache drops the sliding window"),
    Mutation("marian_prompt_without_eos", "jaxformer/interop/tokenizer.py",
             "prompt=lambda s: encode(s) + [eos]", "prompt=lambda s: encode(s)",
             (HF + "test_marian.py",), "Marian source text encoded without its closing </s>"),
    # -- GGUF files: llama.cpp's Q/K permutation, the metadata, the tokenizer (the tiny-file tests: no download)
    Mutation("gguf_llama_not_unpermuted", "jaxformer/interop/gguf.py",
             'PERMUTED = ("llama",)', "PERMUTED = ()",
             (GGUF + "::test_tiny_fixture_as_gguf_matches_transformers",
              GGUF + "::test_unpermuted_state_equals_the_safetensors_load"),
             "llama's W_q / W_k rows read in llama.cpp's interleaved RoPE layout (permutation not undone)"),
    Mutation("gguf_qwen2_unpermuted", "jaxformer/interop/gguf.py",
             'PERMUTED = ("llama",)', 'PERMUTED = ("llama", "qwen2")',
             (GGUF + "::test_tiny_fixture_as_gguf_matches_transformers",),
             "the llama un-permutation applied to qwen2 files too (llama.cpp does not permute them)"),
    Mutation("gguf_k_unpermuted_with_query_heads", "jaxformer/interop/gguf.py",
             '"self_attn.k_proj": hf["num_key_value_heads"]}', '"self_attn.k_proj": hf["num_attention_heads"]}',
             (GGUF + "::test_tiny_fixture_as_gguf_matches_transformers",),
             "W_k un-permuted in query-head groups (GQA: llama.cpp permutes it per kv head)"),
    Mutation("gguf_tied_head_inverted", "jaxformer/interop/gguf.py",
             'tie_word_embeddings="output.weight" not in g.tensors,', 'tie_word_embeddings="output.weight" in g.tensors,',
             (GGUF + "::test_config_mapping",), "a file without output.weight read as an untied head"),
    Mutation("gguf_spm_prefix_inverted", "jaxformer/interop/gguf.py",
             'scheme = "first" if prefix else "never"', 'scheme = "never" if prefix else "first"',
             (GGUF + "::test_sentencepiece_vocabulary_matches_transformers",),
             "a SentencePiece vocabulary's leading \u2581 not prepended"),
    # -- study options, the attention probe, the sweep runner, evaluation at another length
    Mutation("attn_scale_ignored", "jaxformer/nn/attention.py",
             "self.scale = 1.0 / math.sqrt(H) if cfg.scale is None else float(cfg.scale)",
             "self.scale = 1.0 / math.sqrt(H)",
             MODEL, "attn_scale ignored: always 1/sqrt(H)"),
    Mutation("q_init_scale_ignored", "jaxformer/nn/attention.py",
             "normal(qk_std * q_scale)", "normal(qk_std)",
             MODEL, "attention.q_init_scale ignored: W_q starts at the model's init std"),
    Mutation("q_init_scale_on_w_k_too", "jaxformer/nn/attention.py",
             'param(rngs, normal(qk_std), (d_model, K, H)', 'param(rngs, normal(qk_std * q_scale), (d_model, K, H)',
             MODEL, "attention.q_init_scale scales W_k's init as well as W_q's"),
    Mutation("xavier_init_scheme_ignored", "jaxformer/model/stack.py",
             'if deepnorm or cfg.init_scheme == "xavier":', "if deepnorm:",
             MODEL, "init_scheme xavier ignored: the blocks start at N(0, init_std)"),
    Mutation("trained_counts_diverged", "jaxformer/study/report.py",
             "trained = [r for r in ok if", "trained = [r for r in rs if",
             ("tests/study/test_sweep_tune.py",), "report.trained_below counts a diverged run that ended low as trained"),
    Mutation("twin_seed_unchecked", "jaxformer/study/sweep.py",
             "(t.values, t.seed, t.tuned) == (point.values, point.seed, point.tuned)",
             "(t.values, t.tuned) == (point.values, point.tuned)",
             ("tests/study/test_sweep_tune.py",), "a final point copies its arm's tuning run whatever its seed"),
    Mutation("twin_copy_keeps_tuning_row", "jaxformer/study/sweep.py",
             "row.update(name=point.name, tuning=False, copy_of=twin.name)", "row.update(copy_of=twin.name)",
             ("tests/study/test_sweep_tune.py",), "a final point copied from its tuning twin keeps the twin's name "
             "and tuning flag (the report would file it with the tuning rows)"),
    Mutation("shared_qk_keeps_w_k", "jaxformer/nn/attention.py",
             'if share == "none" else None)',
             'if share != "qkv" else None)',
             (*MODEL, "tests/model/test_config.py"), "qkv_sharing='qk' still builds and uses its own W_k"),
    Mutation("logit_var_sample", "jaxformer/ops/attention.py",
             "var = jnp.where(allowed, (s - mean[..., None]) ** 2, 0.0).sum(-1) / n_safe",
             "var = jnp.where(allowed, (s - mean[..., None]) ** 2, 0.0).sum(-1) / jnp.maximum(n - 1.0, 1.0)",
             ("tests/ops/test_attention.py", "tests/study/test_probes.py"),
             "logit variance with n-1 (sample) instead of the row's own spread"),
    Mutation("probe_grad_wrong_leaves", "jaxformer/study/probes.py",
             'in ("w_q", "w_k") for k in path)',
             'in ("w_q", "w_v") for k in path)',
             ("tests/study/test_probes.py",), "probe's Q/K gradient norm taken over W_q and W_v"),
    Mutation("bucket_by_row_index", "jaxformer/train/evaluation.py",
             'idx = b.positions[where] // width',
             'idx = np.broadcast_to(np.arange(where.shape[1]), where.shape)[where] // width',
             ("tests/study/test_sweep.py",), "loss buckets by index in the window, not position in the document"),
    Mutation("length_eval_no_table_growth", "jaxformer/train/evaluation.py",
             "    if seq_len > trained.model.max_seq_len:\n        overrides.append",
             "    if False:\n        overrides.append",
             ("tests/study/test_sweep.py",), "evaluation past the trained context does not extend max_seq_len"),
    Mutation("sweep_seed_ignored", "jaxformer/study/sweep.py",
             'raw["seed"] = seed',
             'raw["seed"] = self.spec.seeds[0]',
             ("tests/study/test_sweep.py",), "every point of a sweep trains with the first seed"),
    Mutation("divergence_only_nan", "jaxformer/study/sweep.py",
             "if last > first * (1 + margin):",
             "if last > first * 100:",
             ("tests/study/test_sweep.py",), "a blown-up but finite run is not recorded as diverged"),
    Mutation("finished_rows_not_rejudged", "jaxformer/study/sweep.py",
             "    verdict = blew_up(losses, margin)\n", "    verdict = blew_up(losses, DEFAULT_MARGIN)\n",
             ("tests/study/test_sweep.py",), "a finished point keeps the default divergence margin's verdict"),
    Mutation("residual_flag_ignored", "jaxformer/nn/block.py",
             "return x + h if self.skip else h",
             "return x + h",
             MODEL, "residual=False still adds the identity path (pre-norm)"),
    Mutation("identity_is_relu", "jaxformer/ops/activations.py",
             '"identity": identity,',
             '"identity": relu,',
             ("tests/ops/test_activations.py", *MODEL), "the identity activation clips at zero"),
    Mutation("dead_units_count_padding", "jaxformer/study/probes.py",
             'real = batch.segment_ids > 0',
             'real = batch.segment_ids >= 0',
             ("tests/study/test_probes.py",), "dead-unit probe lets padding tokens fire units"),
    Mutation("unstack_layers_reversed", "jaxformer/model/layout.py",
             "_take(a, i), blocks)", "_take(a, n - 1 - i), blocks)",
             ("tests/model/test_layout.py", "tests/interop/test_scanned.py", "tests/study/test_probes.py"),
             "scanned -> per-layer weights with the layer order reversed (export, probes)"),
    Mutation("stack_layers_reversed", "jaxformer/model/layout.py",
             "*[blocks[i] for i in range(n)])}", "*[blocks[n - 1 - i] for i in range(n)])}",
             ("tests/interop/test_scanned.py",),
             "a checkpoint's per-layer weights stacked in reverse (scanned load, scanned fine-tune)"),
    Mutation("block_norms_reversed", "jaxformer/train/step.py",
             "for i in sorted(blocks)]",
             "for i in sorted(blocks, reverse=True)]",
             ("tests/study/test_probes.py",), "per-block gradient norms listed last block first"),
    Mutation("stats_count_padding", "jaxformer/ops/attention.py",
             "rows = rows & (jnp.asarray(mask.q_segment_ids) > 0)[:, None, :]",
             "rows = rows",
             ("tests/ops/test_attention.py",), "attention statistics average in the padding rows"),
    Mutation("finished_point_unchecked", "jaxformer/study/sweep.py",
             "    if changed:\n        keys = ",
             "    if False:\n        keys = ",
             ("tests/study/test_sweep.py",), "a finished point run with another config is reported as this one"),
    Mutation("step_spec_horizon_is_steps", "jaxformer/train/step.py",
             "horizon=cfg.schedule.decay_steps or cfg.steps,", "horizon=cfg.steps,",
             ("tests/train/test_step_spec.py",), "the step's spec keys on the run length even under a fixed decay_steps "
             "(a longer resume recompiles)"),
    Mutation("decode_imports_train", "jaxformer/decode/prompts.py",
             "from jaxformer.decode.sampling import SamplingParams\n",
             "from jaxformer.decode.sampling import SamplingParams\nfrom jaxformer.train import tokenizers  # noqa\n",
             ("tests/test_layers.py",), "decode imports train (an upward import DESIGN forbids)"),
    Mutation("quick_plots_unmarked", "jaxformer/study/plots.py",
             "        if quick:  # across the middle of the figure",
             "        if False:  # across the middle of the figure",
             ("tests/study/test_sweep.py::test_a_quick_sweeps_report_says_so_in_its_title_and_on_every_plot",),
             "a --quick sweep's plots look like a real result's (the report's title alone says it)"),
    # -- data and the command line
    Mutation("text_split_overlaps", "jaxformer/train/corpus.py",
             "            train.append(d[:cut])\n", "            train.append(d)\n",
             ("tests/train/test_data.py",), "a one-file text's validation tail is also trained on"),
    Mutation("override_blamed_on_file", "jaxformer/train/config.py",
             'where = source if override is None else f"override {override!r}"', "where = source",
             ("tests/test_cli.py",), "a typo in a key=value override is reported against the YAML file"),
    # -- ModelConfig's sections: the flat keys of before, merging, the class per kind
    Mutation("migrate_overwrites_section", "jaxformer/model/config.py",
             "out[section] = {**given, **values}", "out[section] = values",
             ("tests/model/test_config_sections.py",), "a flat key replaces its whole section (the section's other fields lost)"),
    Mutation("merge_replaces_section", "jaxformer/model/config.py",
             "out[key] = {**out[key], **value}", "out[key] = value",
             ("tests/model/test_config_sections.py",), "replace / presets.get drop a section's fields the change does not name"),
    Mutation("override_flat_key_not_moved", "jaxformer/train/config.py",
             'return ["model", *where]', "return list(parts)",
             ("tests/model/test_config_sections.py",), "a model.FLAT=value override set beside the section instead of in it"),
    Mutation("norm_mapping_read_as_kind", "jaxformer/model/config.py",
             'if key == "norm" and isinstance(value, (dict, BaseModel)):', "if False:",
             ("tests/model/test_config_sections.py",), "a norm: {...} section read as the old flat norm kind"),
    Mutation("get_key_ignores_flat_names", "jaxformer/model/config.py",
             "where = FLAT_KEYS.get(key)", "where = None",
             ("tests/model/test_config_sections.py",), "get_key reads a flat name as a top-level field"),
    Mutation("one_class_for_every_kind", "jaxformer/model/transformer.py",
             "cls = MODEL_CLASSES[config.kind]", "cls = DecoderLM",
             ("tests/model/test_config_sections.py",), "Transformer(config) builds a DecoderLM whatever the kind"),
    # -- ops: positions, masks, norms, activations, attention, loss
    Mutation("rope_exponent", "jaxformer/ops/positional.py",
             "exponent = np.arange(0, H, 2, dtype=np.float64) / H",
             "exponent = np.arange(2, H + 2, 2, dtype=np.float64) / H",
             ("tests/ops/test_positional.py", *MODEL), "RoPE frequency exponent one step off"),
    Mutation("sinusoid_swap", "jaxformer/ops/positional.py",
             "pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)",
             "pe = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=-1)",
             ("tests/ops/test_positional.py", *MODEL), "sinusoidal positions: sin and cos swapped"),
    Mutation("alibi_slopes", "jaxformer/ops/positional.py",
             "return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]",
             "return [2.0 ** (-8.0 * i / n) for i in range(0, n)]",
             ("tests/ops/test_positional.py", *MODEL), "ALiBi slopes start at 2^0 instead of 2^(-8/N)"),
    Mutation("alibi_bias_sign", "jaxformer/ops/attention.py",
             "return -slopes[:, :, None, None] * dist.astype(jnp.float32)",
             "return slopes[:, :, None, None] * dist.astype(jnp.float32)",
             (*ATTN, *MODEL), "ALiBi bias added instead of subtracted (xla path)"),
    # the one mask rule every path evaluates: only tests against an independent definition catch these
    Mutation("causal_lt", "pallas_kernels/mask.py",
             "hard.append(k_pos <= q_pos)", "hard.append(k_pos < q_pos)",
             ("tests/ops/test_masks.py", "tests/pallas_kernels/test_flash_api.py"),
             "causal mask excludes the diagonal"),
    Mutation("window_left", "pallas_kernels/mask.py",
             "band = k_pos >= q_pos - left", "band = k_pos > q_pos - left",
             ("tests/ops/test_masks.py", "tests/pallas_kernels/test_flash_api.py"), "window's left edge one short"),
    Mutation("kv_lengths_le", "pallas_kernels/mask.py",
             "hard.append(k_pos < kv_length)", "hard.append(k_pos <= kv_length)",
             ("tests/ops/test_masks.py", "tests/pallas_kernels/test_flash_api.py"),
             "padding length lets one padded key through"),
    Mutation("rms_eps_outside", "jaxformer/ops/normalization.py",
             "xf * jax.lax.rsqrt(ms + eps)", "xf / (jnp.sqrt(ms) + eps)",
             ("tests/ops/test_normalization.py",), "RMSNorm eps outside the square root"),
    Mutation("rms_no_eps", "jaxformer/ops/normalization.py",
             "xf * jax.lax.rsqrt(ms + eps)", "xf * jax.lax.rsqrt(ms)",
             ("tests/ops/test_normalization.py",), "RMSNorm without eps"),
    Mutation("ln_no_center", "jaxformer/ops/normalization.py",
             "y = centred * jax.lax.rsqrt(var + eps)", "y = xf * jax.lax.rsqrt(var + eps)",
             ("tests/ops/test_normalization.py",), "LayerNorm scales x instead of x - mean"),
    Mutation("swiglu_gelu", "jaxformer/ops/activations.py",
             "    return silu(gate) * up", "    return gelu(gate) * up",
             ("tests/ops/test_activations.py", *MODEL), "SwiGLU gated by GeLU"),
    Mutation("ffn_width", "jaxformer/ops/activations.py",
             "hidden = 8 * d_model // 3 if is_gated(activation) else 4 * d_model",
             "hidden = 4 * d_model",
             ("tests/ops/test_activations.py", "tests/model/test_config.py"), "gated FFN width 4d instead of 8d/3"),
    Mutation("attn_scale", "jaxformer/ops/attention.py",
             "scale = 1.0 / math.sqrt(H) if scale is None else scale",
             "scale = 1.0 / H if scale is None else scale",
             ATTN, "attention scaled by 1/H instead of 1/sqrt(H) (xla path)"),
    Mutation("softcap_skipped", "jaxformer/ops/attention.py",
             "        s = softcap * jnp.tanh(s / softcap)\n    if bias is not None:",
             "        s = s\n    if bias is not None:",
             ATTN, "softcap ignored (xla path)"),
    # -- the dense training path (impl="xla" without bias / ALiBi / softcap, K = N): chunks and hand derivative
    Mutation("dense_chunk_keys", "jaxformer/ops/attention.py",
             "return tuple((a, b, min(S, off + b)) for a, b in itertools.pairwise(edges))",
             "return tuple((a, b, min(S, off + a + 1)) for a, b in itertools.pairwise(edges))",
             ATTN, "a causal query chunk sees only the keys up to its first row"),
    Mutation("dense_dinv_sign", "jaxformer/ops/attention.py",
             "t_inv = -inv * inv * jnp.sum(te, axis=-1)", "t_inv = inv * inv * jnp.sum(te, axis=-1)",
             ATTN, "derivative of the softmax normaliser with the wrong sign"),
    Mutation("dense_dv_missing", "jaxformer/ops/attention.py",
             "+ jnp.einsum(\"BNTS,BSNH->BTNH\", e.astype(v.dtype), tv[:, :n], preferred_element_type=f32))",
             "+ 0.0 * jnp.einsum(\"BNTS,BSNH->BTNH\", e.astype(v.dtype), tv[:, :n], preferred_element_type=f32))",
             ATTN, "the dense path's tangent (and so gradient) drops the v term"),
    Mutation("dense_route_drops_alibi", "jaxformer/ops/attention.py",
             "if (bias is None and not return_weights and alibi_slopes is None and softcap is None and K == N",
             "if (bias is None and not return_weights and softcap is None and K == N",
             ATTN + MODEL, "ALiBi models routed to the dense path, which ignores the slopes"),
    Mutation("softmax_denominator", "jaxformer/ops/masks.py",
             "return p / jnp.where(denom == 0.0, 1.0, denom)", "return p / (denom + 1e-3)",
             ATTN, "masked softmax denominator off"),
    Mutation("gqa_grouping", "jaxformer/ops/attention.py",
             'qg = q.reshape(B, T, K, G, H)\n    s = jnp.einsum("BTKGH,BSKH->BKGTS"',
             'qg = q.reshape(B, T, G, K, H).swapaxes(2, 3)\n    s = jnp.einsum("BTKGH,BSKH->BKGTS"',
             ATTN, "GQA: query heads grouped with the wrong kv head"),
    Mutation("ce_mask_ignored", "jaxformer/ops/losses.py",
             "ce = jnp.sum(jnp.where(mask, log_z - target_logit, 0.0)) / denom",
             "ce = jnp.sum(log_z - target_logit) / denom",
             ("tests/ops/test_losses.py",), "cross entropy counts masked tokens"),
    # -- attention paths: blockwise, sparse, kernels' references and kernels
    Mutation("blockwise_bwd_delta", "jaxformer/ops/blockwise.py",
             "ds = p * (dp - delta_i) * dscale", "ds = p * dp * dscale",
             ("tests/ops/test_blockwise.py",), "blockwise backward forgets the softmax correction"),
    Mutation("blockwise_kv_padding", "jaxformer/ops/blockwise.py",
             "lengths[:, None, None], num_keys=cfg.S)", "lengths[:, None, None], num_keys=cfg.S + 1)",
             ("tests/ops/test_blockwise.py",), "blockwise lets one padded key of the last kv block through"),
    Mutation("blockwise_traced_range_all", "jaxformer/ops/blockwise.py",
             "hi = cfg.nk if last is None else jnp.clip(jnp.max(last) // cfg.bk + 1, 0, cfg.nk)",
             "hi = cfg.nk", ("tests/ops/test_blockwise.py",),
             "blockwise with a traced offset reads the kv blocks past every row's band and length"),
    Mutation("blockwise_traced_range_short", "jaxformer/ops/blockwise.py",
             "hi = cfg.nk if last is None else jnp.clip(jnp.max(last) // cfg.bk + 1, 0, cfg.nk)",
             "hi = cfg.nk if last is None else jnp.clip(jnp.max(last) // cfg.bk, 0, cfg.nk)",
             ("tests/ops/test_blockwise.py",), "blockwise with a traced offset drops the last live kv block"),
    Mutation("blockwise_traced_range_lo_late", "jaxformer/ops/blockwise.py",
             "lo = 0 if first is None else jnp.clip(jnp.min(first) // cfg.bk, 0, cfg.nk)",
             "lo = 0 if first is None else jnp.clip(jnp.max(first) // cfg.bk, 0, cfg.nk)",
             ("tests/ops/test_blockwise.py",), "blockwise with a traced offset starts at the latest row's window"),
    Mutation("blockwise_traced_range_idle_rows", "jaxformer/ops/blockwise.py",
             "first = jnp.where(jnp.maximum(first, 0) <= last, first, cfg.nk * cfg.bk)", "pass",
             ("tests/ops/test_blockwise.py",), "an idle row (length 0) pulls a window's first kv block back to 0"),
    Mutation("blockwise_out_layout", "jaxformer/ops/blockwise.py",
             "o = jnp.transpose(o, (1, 0, 3, 2, 4, 5))", "o = jnp.transpose(o, (1, 0, 2, 3, 4, 5))",
             ("tests/ops/test_blockwise.py",), "blockwise output [B,K,T,G,H] tiles read back with K and T mixed"),
    Mutation("paged_prefill_auto_dense", "jaxformer/decode/paged_cache.py",
             'softcap=softcap, impl="blockwise" if impl == "auto" else impl)', "softcap=softcap, impl=impl)",
             ("tests/decode/test_paged_cache.py",), "a prefill chunk over the pages takes the dense reference on CPU"),
    Mutation("paged_write_clamps_past_table", "jaxformer/decode/paged_cache.py",
             "& (pos < M * L), page, P)", ", page, P)",
             ("tests/decode/test_paged_cache.py",), "a token past the block table is clamped onto a cached row"),
    Mutation("engine_auto_id_collides", "jaxformer/decode/engine.py",
             "            while in_use(rid):\n                rid = next(self._ids)\n", "",
             ("tests/decode/test_engine.py",), "an automatic request id may be one a caller already named"),
    Mutation("paged_api_float_scale_early", "pallas_kernels/paged_attention/api.py",
             "scale = 1.0 / math.sqrt(H) if scale is None else scale\n",
             "scale = 1.0 / math.sqrt(H) if scale is None else float(scale)\n",
             ("tests/pallas_kernels/test_paged_attention.py",), "paged_attention refuses a traced scale on every backend"),
    Mutation("sweep_report_ignores_row_files", "jaxformer/study/sweep.py",
             "        return recorded_row(sweep, out, point) if recorded else None\n", "        return None\n",
             ("tests/study/test_sweep_tune.py",), "--report without the run directories empties summary.jsonl"),
    Mutation("sweep_report_trusts_stale_run_dirs", "jaxformer/study/sweep.py",
             'if recorded and row.get("config") is not None and not is_current(sweep, out, point, row):',
             "if False:",
             ("tests/study/test_sweep_tune.py",), "--report shows a run of an older sweep design as one of its points"),
    Mutation("sweep_supersede_moves_any_final", "jaxformer/study/sweep.py",
             'if supersede and not point.tuning and done.get("config") is not None and done.get("tuned") != resolved.tuned:',
             'if supersede and not point.tuning:',
             ("tests/study/test_sweep_tune.py",), "--supersede moves and re-runs finals whose arm's choice did not move"),
    Mutation("sweep_report_trusts_stale_rows", "jaxformer/study/sweep.py",
             "return not C.diff(saved, quick_config(cfg) if row.get(\"quick\") else cfg)",
             "return True",
             ("tests/study/test_sweep_tune.py",), "a row of an older sweep design is reported as one of its points"),
    Mutation("sweep_report_drops_superseded", "jaxformer/study/report.py",
             "        _write_rows(out / SUPERSEDED, read_rows(out / SUPERSEDED) + superseded)\n", "        pass\n",
             ("tests/study/test_sweep_tune.py",), "rows the sweep no longer gives are deleted from summary.jsonl"),
    Mutation("sweep_report_redraws_curves_without_runs", "jaxformer/study/plots.py",
             "if name in CURVE_PLOTS and runs_missing:", "if False:",
             ("tests/study/test_sweep_tune.py",), "a rebuilt report overwrites the curve plots with empty ones"),
    Mutation("sweep_report_ignores_points_dir", "jaxformer/study/sweep.py",
             "return kept if not (here / POINT_FILE).exists() and (kept / POINT_FILE).exists() else here",
             "return here", ("tests/study/test_sweep_tune.py",), "a study's committed points/ are not read"),
    Mutation("sweep_report_keeps_untuned_finals", "jaxformer/study/sweep.py",
             'if chosen is not None and row.get("tuned") != chosen:', "if False:",
             ("tests/study/test_sweep_tune.py",), "a recorded final row at a value its arm no longer chooses is reported"),
    Mutation("sweep_skips_stale_finals_mid_run", "jaxformer/study/sweep.py",
             "        done = finished(point)\n", "        done = read_point(sweep, out, point, recorded=False)\n",
             ("tests/study/test_sweep_tune.py",),
             "finals of an arm whose tuning finished in the same run are not checked against its choice"),
    Mutation("sweep_runs_from_recorded_rows", "jaxformer/study/sweep.py",
             "        done = read_point(sweep, out, point, recorded=False)\n        if done is None or",
             "        done = read_point(sweep, out, point)\n        if done is None or", ("tests/study/test_sweep_tune.py",),
             "a point whose run directory was deleted is skipped as finished because summary.jsonl holds its row"),
    Mutation("study_dead_units_for_every_activation", "jaxformer/study/rows.py",
             "    if key in DEAD_KEYS and (row.get", "    if False and (row.get",
             ("tests/study/test_sweep_tune.py",), "GeLU / SwiGLU units never positive are reported as dead"),
    Mutation("sweep_report_overwrites_rerun_rows", "jaxformer/study/report.py",
             'return now is None or any(r.get(k) != now.get(k) for k in ("config", "tuned", "seed"))',
             "return now is None", ("tests/study/test_sweep_tune.py",),
             "an old row whose point was run again is overwritten, not kept in superseded.jsonl"),
    Mutation("sweep_report_row_at_any_tuned_value", "jaxformer/study/sweep.py",
             "    if point.tuning or sweep.spec.tune is None:  # the point's config is whole already\n        cfg = point.config\n",
             "    if point.tuning:\n        cfg = point.config\n    elif sweep.spec.tune is None:\n"
             "        cfg = sweep.config({**point.values, **(row.get('tuned') or {})}, point.seed, 'x')\n",
             ("tests/study/test_sweep_tune.py",), "without tune:, a final row is accepted at the rate it was tuned to"),
    Mutation("engine_copies_at_construction", "jaxformer/decode/engine.py",
             "self._feature_major = None  # built at the first call",
             "self._feature_major = step_model(graphdef, state, o.feature_major)  # built at the first call",
             ("tests/decode/test_step_work.py",), "the engine copies its FFNs when built, even if it never batches"),
    Mutation("engine_copies_for_every_call", "jaxformer/decode/engine.py",
             "if rows not in FEATURE_MAJOR_ROWS or o.feature_major is False:", "if o.feature_major is False:",
             ("tests/decode/test_step_work.py",), "every call, one row or a long chunk, builds and runs the FFN copies"),
    Mutation("sparse_global_keys", "jaxformer/ops/sparse.py",
             "num_keys=S, kv_global=mask.is_global(kpos), random=random)", "num_keys=S, random=random)",
             ("tests/ops/test_sparse.py",), "sparse blocked part forgets the global keys"),
    Mutation("flash_ref_causal", "pallas_kernels/flash_attention/reference.py",
             "ok = ok & (kpos <= qpos)[None, None]", "ok = ok & (kpos < qpos)[None, None]",
             ("tests/pallas_kernels/test_flash_api.py",), "flash reference: causal excludes the diagonal"),
    Mutation("flash_tile_padding", "pallas_kernels/kernel_mask.py",
             "num_keys=self.kv_len if check_kv_len else None", "num_keys=None",
             ("tests/pallas_kernels/test_flash_api.py", "tests/pallas_kernels/test_flash_gpu.py"),
             "kernels' tile mask lets the wrappers' key padding through"),
    Mutation("schedule_kv_range_short", "pallas_kernels/schedule.py",
             "hi = _min(hi, _div(_max(last, -1) + bk, bk))", "hi = _min(hi, _div(_max(last, -1) + bk - 1, bk))",
             ("tests/pallas_kernels/test_flash_api.py",), "block schedule drops the last live kv block of a q block"),
    Mutation("schedule_band_right", "pallas_kernels/schedule.py",
             "last = q_pos + right if last is None else _min(last, q_pos + right)",
             "last = q_pos + right + 1 if last is None else _min(last, q_pos + right + 1)",
             ("tests/pallas_kernels/test_flash_api.py", "tests/ops/test_masks.py"),
             "the band's right edge one key too far in the schedule and MaskSpec.block_map"),
    Mutation("flash_gpu_rescale", "pallas_kernels/flash_attention/gpu.py",
             "acc = acc * alpha[:, None] + _dot(pr.astype(v.dtype), v, (1, 0))",
             "acc = acc + _dot(pr.astype(v.dtype), v, (1, 0))",
             ("tests/pallas_kernels/test_flash_gpu.py",), "GPU flash forward: accumulator not rescaled"),
    Mutation("flash_tpu_rescale", "pallas_kernels/flash_attention/tpu.py",
             "acc_sc[...] = alpha * acc_sc[...] + pv", "acc_sc[...] = acc_sc[...] + pv",
             ("tests/pallas_kernels/test_flash_tpu.py",), "TPU flash forward: accumulator not rescaled"),
    Mutation("paged_xla_gather_kv_heads_swapped", "pallas_kernels/paged_attention/xla.py",
             "rows = (jnp.arange(K, dtype=jnp.int32)[None, :, None] * P",
             "rows = (jnp.arange(K, dtype=jnp.int32)[::-1][None, :, None] * P",
             ("tests/pallas_kernels/test_paged_attention.py",), "the CPU's long-context decode reads another kv head's pages"),
    Mutation("paged_xla_never", "pallas_kernels/paged_attention/api.py",
             'backend = "xla" if long and jax.sharding.get_abstract_mesh().empty else "reference"',
             'backend = "reference"',
             ("tests/pallas_kernels/test_paged_attention.py",), "the CPU never takes the long-context decode form"),
    Mutation("paged_xla_logits_unswapped", "pallas_kernels/paged_attention/xla.py",
             "s = jnp.swapaxes(jax.lax.optimization_barrier(s), 2, 3)",
             "s = jax.lax.optimization_barrier(s).reshape(s.shape[0], s.shape[1], s.shape[3], s.shape[2])",
             ("tests/pallas_kernels/test_paged_attention.py",), "the CPU's long-context decode logits laid out by a reshape, not a transpose"),
    Mutation("paged_ref_length", "pallas_kernels/paged_attention/reference.py",
             "valid = pos[None, :] < lengths[:, None]", "valid = pos[None, :] <= lengths[:, None]",
             ("tests/pallas_kernels/test_paged_attention.py",), "paged reference reads one token past the length"),
    # -- decode: sampling
    Mutation("top_k_off_by_one", "jaxformer/decode/sampling.py",
             "desc = jnp.where(rank < k[:, None], desc, -jnp.inf)",
             "desc = jnp.where(rank <= k[:, None], desc, -jnp.inf)",
             ("tests/decode/test_sampling.py",), "top-k keeps k+1 tokens"),
    Mutation("temperature_inverted", "jaxformer/decode/sampling.py",
             "x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None]",
             "x = logits.astype(jnp.float32) * jnp.where(t > 0, t, 1.0)[:, None]",
             ("tests/decode/test_sampling.py",), "temperature multiplies the logits"),
    Mutation("top_p_strict", "jaxformer/decode/sampling.py",
             "n_keep = jnp.sum((before < top_p) | (top_p >= 1.0), axis=-1)",
             "n_keep = jnp.sum((before + probs < top_p) | (top_p >= 1.0), axis=-1)",
             ("tests/decode/test_sampling.py",), "top-p drops the token that crosses p"),
    Mutation("top_p_zero_keeps_all", "jaxformer/decode/sampling.py",
             "n_keep = jnp.clip(jnp.minimum(n_keep, k), 1, V)", "n_keep = jnp.clip(jnp.minimum(n_keep, k), 0, V)",
             ("tests/decode/test_sampling.py", "tests/serve/test_server.py"),
             "top_p 0 keeps no token, so the threshold falls off the end and every token is kept"),
    # -- decode: paged block manager, caches, engine
    Mutation("cow_skipped", "jaxformer/decode/block_manager.py",
             "cow = [i for i in range(first, min(last + 1, len(seq.table))) if self._ref[seq.table[i]] > 1]",
             "cow = []",
             ("tests/decode/test_block_manager.py", "tests/decode/test_paged_cache.py"),
             "a write into a shared page does not copy it first"),
    Mutation("release_leaks", "jaxformer/decode/block_manager.py",
             "        if self._ref[page] == 0:\n            h = self._page_hash.pop(page, None)",
             "        if self._ref[page] == -1:\n            h = self._page_hash.pop(page, None)",
             ("tests/decode/test_block_manager.py",), "freed pages never return to the free list"),
    Mutation("prefix_hash_blind", "jaxformer/decode/block_manager.py",
             "h = _chain_hash(h, tokens[i * L:(i + 1) * L])", "h = _chain_hash(h, tokens[i * L:(i + 1) * L - 1])",
             ("tests/decode/test_block_manager.py", "tests/decode/test_engine.py"),
             "prefix sharing ignores the last token of each block"),
    Mutation("out_of_pages_partial", "jaxformer/decode/block_manager.py",
             "        if need > self.num_free:\n", "        if need > self.num_free + 1:\n",
             ("tests/decode/test_block_manager.py",), "admission checks one page too few"),
    Mutation("window_drop_early", "jaxformer/decode/block_manager.py",
             "n = min(pos // self.page_size - seq.dropped, len(seq.table))",
             "n = min(pos // self.page_size + 1 - seq.dropped, len(seq.table))",
             ("tests/decode/test_window.py",), "sliding window frees a page still inside the window"),
    Mutation("table_width_floor", "jaxformer/decode/engine.py",
             "M = table_width(max(-(-(start - offset + n) // L) for",
             "M = table_width(max((start - offset + n) // L for",
             ("tests/decode/test_step_work.py",),
             "a step's block table one page too narrow when its longest sequence ends mid-page"),
    Mutation("table_width_shortest", "jaxformer/decode/engine.py",
             "M = table_width(max(-(-(start - offset + n) // L) for",
             "M = table_width(min(-(-(start - offset + n) // L) for",
             ("tests/decode/test_step_work.py",), "a step's table width from its shortest sequence, not its longest"),
    Mutation("table_width_capacity", "jaxformer/decode/engine.py",
             "    return bucket(pages, -(-MIN_TABLE_TOKENS // page_size), capacity)",
             "    return capacity",
             ("tests/decode/test_step_work.py",), "every step reads the whole table (the capacity), as before issue 23"),
    Mutation("batch_rows_full", "jaxformer/decode/engine.py",
             "B = bucket(len(plan), 1, self.max_batch)", "B = self.max_batch",
             ("tests/decode/test_step_work.py",), "every step runs max_batch rows, however few sequences"),
    Mutation("project_as_batched_einsum", "jaxformer/nn/params.py",
             "y = jnp.matmul(x2, w2, preferred_element_type=preferred_element_type)\n"
             "    return y.reshape(*lead, math.prod(outer)).reshape(lead + outer)",
             "return jnp.tensordot(x.astype(dtype), w.astype(dtype), n_in, preferred_element_type=preferred_element_type)",
             ("tests/nn/test_params.py",), "projections contract [B, T, D] directly (the slow weight-gradient form)"),
    Mutation("project_weight_read_transposed", "jaxformer/nn/params.py",
             "w2 = w.astype(dtype).reshape(math.prod(inner), math.prod(outer))",
             "w2 = w.astype(dtype).reshape(math.prod(outer), math.prod(inner)).T",
             ("tests/nn/test_params.py",), "a projection's weight flattened in the wrong order"),
    Mutation("project_reshape_in_one_step", "jaxformer/nn/params.py",
             "return y.reshape(*lead, math.prod(outer)).reshape(lead + outer)", "return y.reshape(lead + outer)",
             ("tests/nn/test_params.py",), "the result's rows and features unflattened in one reshape (explicit meshes refuse it)"),
    Mutation("project_shape_check_off", "jaxformer/nn/params.py",
             "if x.shape[x.ndim - n_in:] != inner:", "if False:",
             ("tests/nn/test_params.py",), "a mismatched projection fails inside reshape with no shapes named"),
    Mutation("lora_as_tensordot", "jaxformer/nn/lora.py",
             "h = project(x, a, self.dtype, n_in=n_in)",
             "h = jnp.tensordot(x, a, axes=n_in)",
             ("tests/nn/test_lora.py",), "LoRA's A contracted over [B, T, D] directly (the slow gradient form)"),
    Mutation("split_matvec_drops_a_part", "jaxformer/nn/params.py",
             "    return parts.sum(0)", "    return parts[0]",
             ("tests/nn/test_params.py",), "a one-row product sums only the first half of its contraction"),
    Mutation("split_matvec_parts_in_bf16", "jaxformer/nn/params.py",
             "                                preferred_element_type=acc)",
             "                                preferred_element_type=None)",
             ("tests/nn/test_params.py",), "bf16 one-row products round each half before the sum"),
    Mutation("split_matvec_never", "jaxformer/nn/params.py",
             "return (rows == 1 and split_len % MATVEC_SPLIT == 0", "return (rows == 0 and split_len % MATVEC_SPLIT == 0",
             ("tests/nn/test_params.py",), "batch-1 decode products never split (the slow one-row form)"),
    Mutation("split_matvec_many_rows", "jaxformer/nn/params.py",
             "return (rows == 1 and split_len % MATVEC_SPLIT == 0", "return (rows >= 1 and split_len % MATVEC_SPLIT == 0",
             ("tests/nn/test_params.py",), "products of several rows split too (slower from 2 rows on)"),
    Mutation("project_rows_halves_swapped", "jaxformer/nn/params.py",
             "    return parts.reshape(x.shape[:-1] + (o,))", "    return parts[::-1].reshape(x.shape[:-1] + (o,))",
             ("tests/nn/test_params.py",), "the tied head's one-row logits come back with the vocabulary's halves swapped"),
    Mutation("feature_major_never", "jaxformer/nn/mlp.py",
             "return (rows in FEATURE_MAJOR_ROWS and not module.record_stats",
             "return (rows in () and not module.record_stats",
             ("tests/nn/test_modules.py",), "the FFN's [F, D] copies are never used (every call takes the usual path)"),
    Mutation("feature_major_off_on_cpu", "jaxformer/decode/engine.py",
             'if feature_major is None and jax.default_backend() == "cpu":',
             'if feature_major is None and jax.default_backend() != "cpu":',
             ("tests/decode/test_step_work.py",), "the engine's default leaves feature-major steps off on the CPU"),
    Mutation("feature_major_threshold_ignored", "jaxformer/nn/mlp.py",
             "and math.prod(getattr(m, names[0]).shape[-2:]) >= min_weights):  # the fast path has no adapters",
             "and math.prod(getattr(m, names[0]).shape[-2:]) >= 0):  # the fast path has no adapters",
             ("tests/decode/test_step_work.py",), "the CPU default gives copies to FFNs of any size (tiny ones run slower)"),
    Mutation("feature_major_bypasses_down_adapter", "jaxformer/nn/mlp.py",
             'INPUTS, PROJECTIONS = ("w_gate", "w_up"), ("w_gate", "w_up", "w_down")',
             'INPUTS, PROJECTIONS = ("w_gate", "w_up"), ("w_gate", "w_up")',
             ("tests/nn/test_modules.py",), "an FFN with a LoRA adapter on W_down gets copies (its adapter bypassed)"),
    Mutation("feature_major_ignores_adapters_at_call", "jaxformer/nn/mlp.py",
             'and all(getattr(module, f"{k}_lora") is None for k in module.PROJECTIONS))',
             'and all(getattr(module, f"{k}_lora") is None for k in module.PROJECTIONS[:0]))',
             ("tests/nn/test_modules.py",), "a call with copies takes the fast path even with adapters (bypassing them)"),
    Mutation("serve_profile_decode_as_prefill", "experiments/bench/serve.py",
             'kind = f"decode B={rows}" if new <= rows else "with prefill"',
             'kind = f"decode B={rows}" if new < rows else "with prefill"',
             ("tests/decode/test_decode_bench.py",), "the serving bench's profile counts full decode steps as prefill"),
    Mutation("head_at_first_token", "jaxformer/decode/engine.py",
             "logits_at=jnp.maximum(inputs.num_new - 1, 0))", "logits_at=jnp.zeros_like(inputs.num_new))",
             ("tests/decode/test_engine.py",), "the engine samples from the logits of each chunk's first token"),
    Mutation("logits_at_last_column", "jaxformer/model/transformer.py",
             "x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)",
             "x = x[:, -1:]",
             ("tests/decode/test_step_work.py",), "logits_at ignored: the head runs at the last column of every row"),
    Mutation("kv_cache_offset", "jaxformer/decode/kv_cache.py",
             "mask = MaskSpec(causal=True, window=band, q_offset=self.lengths, kv_lengths=self.lengths + T)",
             "mask = MaskSpec(causal=True, window=band, q_offset=self.lengths + 1, kv_lengths=self.lengths + T)",
             ("tests/decode/test_kv_cache.py", "tests/model/test_transformer.py"),
             "KV cache: new queries placed one position late"),
    # -- train: optimiser, schedule, checkpoints, metrics
    Mutation("clip_x100", "jaxformer/train/optim.py",
             "optax.clip_by_global_norm(opt.clip_norm)", "optax.clip_by_global_norm(opt.clip_norm * 100)",
             ("tests/train/test_optim.py",), "gradient clipping threshold x100"),
    Mutation("decay_norms", "jaxformer/train/optim.py",
             '"norm": opt.decay_norms,', '"norm": True,',
             ("tests/train/test_optim.py",), "weight decay applied to norm scales"),
    Mutation("warmup_from_peak", "jaxformer/train/optim.py",
             "optax.linear_schedule(0.0, peak, warm)", "optax.linear_schedule(peak, peak, warm)",
             ("tests/train/test_optim.py",), "no warmup (starts at the peak)"),
    Mutation("resume_without_data_state", "jaxformer/train/checkpoint.py",
             'items["data"] = grain.checkpoint.CheckpointRestore(data_iter)', "pass",
             ("tests/train/test_checkpoint.py", "tests/train/test_resume.py"),
             "resume restores the weights but not the data iterator"),
    Mutation("fingerprint_ignored", "jaxformer/train/checkpoint.py",
             'if not _matches(fingerprint(state["params"]), meta.get("fingerprint", [])):',
             "if False:",
             ("tests/train/test_checkpoint.py",), "a corrupt checkpoint is restored as if good"),
    Mutation("interrupt_not_saved", "jaxformer/train/loop.py",
             "            if stopping or s % cfg.checkpoint.every == 0 or s == cfg.steps:",
             "            if s % cfg.checkpoint.every == 0 or s == cfg.steps:",
             ("tests/train/test_interrupt.py",), "SIGINT / SIGTERM stop the run without checkpointing the step"),
    Mutation("second_signal_waits", "jaxformer/train/loop.py",
             "            if self.signum is not None or self.step is None or self.done:",
             "            if self.step is None or self.done:",
             ("tests/train/test_interrupt.py",), "a second Ctrl-C waits for the checkpoint instead of exiting at once"),
    Mutation("corpus_before_checks", "jaxformer/train/loop.py",
             "            at = saved_step(ckpt, trainer, run_dir, changed)",
             "            build_corpus(cfg.data, tokenizer_path=saved_tokenizer_path(cfg, run_dir))\n"
             "            at = saved_step(ckpt, trainer, run_dir, changed)",
             ("tests/train/test_check_first.py",), "refusals and no-ops build the corpus (half a minute) first"),
    Mutation("eta_counts_all_steps", "jaxformer/train/metrics.py",
             "return (self.total - step) * (now - t) / (step - s)", "return self.total * (now - t) / (step - s)",
             ("tests/train/test_progress.py",), "the plain progress line's ETA counts every step, not those left"),
    Mutation("cpu_peak_last_probe", "jaxformer/train/metrics.py",
             "    return max(_cpu_probes)", "    return _cpu_probes[-1]",
             ("tests/train/test_progress.py",), "MFU's CPU peak is the latest probe, not the best of them"),
    Mutation("metrics_not_truncated", "jaxformer/train/metrics.py",
             "keep = [r for r in rows if _row_step(r) is not None and _row_step(r) <= resume_step]",
             "keep = rows",
             ("tests/train/test_checkpoint.py", "tests/train/test_resume.py"),
             "resume keeps the interrupted run's rows after the checkpoint"),
    # -- studies: fair tuning, paired intervals, the same evaluation bytes at every length
    Mutation("tune_picks_worst", "jaxformer/study/sweep.py",
             'sign = 1.0 if sweep.spec.tune.mode == "min" else -1.0',
             'sign = -1.0 if sweep.spec.tune.mode == "min" else 1.0',
             ("tests/study/test_sweep_tune.py",), "tuning picks each arm's worst value"),
    Mutation("tune_after_final", "jaxformer/study/sweep.py",
             "mine = shard_points(sweep.tune_points + sweep.points, shard)",
             "mine = shard_points(sweep.points + sweep.tune_points, shard)",
             ("tests/study/test_sweep_tune.py",), "final points run before their arm's tuning points"),
    Mutation("paired_interval_z", "jaxformer/study/stats.py",
             "half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)",
             "half = 1.96 * sd / math.sqrt(n)",
             ("tests/study/test_sweep_stats.py",), "the interval uses the normal 1.96 instead of Student's t"),
    Mutation("paired_unpaired_sd", "jaxformer/study/stats.py",
             "    sd = statistics.stdev(d)\n", "    sd = statistics.stdev([float(arm[s]) for s in seeds])\n",
             ("tests/study/test_sweep_stats.py",), "the interval's sd is the arm's own, not the paired differences'"),
    Mutation("nested_windows_overlap", "jaxformer/train/eval_windows.py",
             "            pieces.append(stream[j:min(j + seq_len + 1, end)])",
             "            pieces.append(stream[j:j + seq_len + 1])",
             ("tests/train/test_eval_windows.py",), "a length's last window scores targets past its span"),
    # -- LoRA and peft adapters (issue 26): the scale, the layouts, the initialisation, what is trained
    Mutation("lora_scale_inverted", "jaxformer/nn/lora.py",
             "return alpha / (math.sqrt(rank) if rslora else rank)",
             "return (math.sqrt(rank) if rslora else rank) / alpha",
             (HF + "test_peft.py",), "LoRA scale rank / alpha instead of alpha / rank"),
    Mutation("lora_rslora_ignored", "jaxformer/nn/lora.py",
             "return alpha / (math.sqrt(rank) if rslora else rank)", "return alpha / rank",
             (HF + "test_peft.py",), "use_rslora read but the scale stays alpha / rank"),
    Mutation("peft_read_not_transposed", "jaxformer/interop/peft.py",
             "ours = x.T.reshape(leaf.shape)", "ours = x.reshape(leaf.shape)",
             (HF + "test_peft.py",), "peft's lora_A [r, in] / lora_B [out, r] read without the transpose"),
    Mutation("peft_write_b_not_transposed", "jaxformer/interop/peft.py",
             "np.ascontiguousarray(b.reshape(b.shape[0], -1).T)", "np.ascontiguousarray(b.reshape(-1, b.shape[0]))",
             (HF + "test_peft.py",), "lora_B written as a reshape of [r, out] instead of its transpose"),
    Mutation("peft_merge_unscaled", "jaxformer/interop/peft.py",
             "    scale = config.lora.scale\n", "    scale = 1.0\n",
             (HF + "test_peft.py",), "merging adds A B without the alpha / rank scale"),
    Mutation("lora_b_not_zero", "jaxformer/nn/lora.py",
             "self.b = nnx.LoRAParam(jnp.zeros((rank, *out_shape), jnp.float32)",
             "self.b = nnx.LoRAParam(jnp.full((rank, *out_shape), 1e-3, jnp.float32)",
             ("tests/train/test_lora.py",), "B starts non-zero: step 0 is not the base model"),
    Mutation("lora_base_trained", "jaxformer/train/step.py",
             "adapter, frozen = nnx.split_state(abstract, nnx.LoRAParam, ...)",
             "adapter, frozen = nnx.split_state(abstract, nnx.Param, ...)",
             ("tests/train/test_lora.py",), "the whole model is trained (and checkpointed), not the adapter alone"),
    Mutation("tune_edge_by_list_order", "jaxformer/study/report.py",
             "chosen.get(k) in (min(nums), max(nums))", "chosen.get(k) in (vals[0], vals[-1])",
             ("tests/study/test_sweep_tune.py",), "a tuned value at the grid's edge judged by list order, not by size"),
    Mutation("lora_scan_masks_reversed", "jaxformer/train/step.py",
             "keys = jax.vmap(lambda i, k=k: jax.random.fold_in(k, i))(jnp.arange(math.prod(shape[:-1])))",
             "keys = jax.vmap(lambda i, k=k: jax.random.fold_in(k, i))(jnp.arange(math.prod(shape[:-1]))[::-1])",
             ("tests/train/test_lora.py",), "a scanned stack's dropout masks in reverse layer order (not the per-layer ones)"),
    # -- issue 24's narrowed signatures: the settings objects must still reach the code they configure
    Mutation("head_transform_eps_ignored", "jaxformer/nn/embedding.py",
             "make_norm(norm.kind, d_model, eps=norm.eps,", "make_norm(norm.kind, d_model, eps=1e-5,",
             ("tests/nn/test_modules.py",), "HeadTransform's norm ignores NormConfig.eps"),
    Mutation("attention_init_bias_ignored", "jaxformer/nn/attention.py",
             "        qk_std, v_std, o_std, use_bias, q_scale = init\n",
             "        qk_std, v_std, o_std, _, q_scale = init\n        use_bias = False\n",
             (HF + "test_gpt2.py",), "AttentionInit.bias dropped: GPT-2's attention biases never built"),
    Mutation("translate_length_penalty_ignored", "jaxformer/decode/translate.py",
             "cand_scores = values / np.float32(float(cur) ** length_penalty)",
             "cand_scores = values / np.float32(float(cur))",
             (HF + "test_marian.py",), "TranslationConfig.length_penalty not applied to finished hypotheses"),
    Mutation("translate_suppress_ignored", "jaxformer/decode/translate.py",
             "    banned[list(suppress_ids)] = True\n", "",
             (HF + "test_marian.py",), "TranslationConfig.suppress_ids may be generated"),
    Mutation("decode_memory_lengths_dropped", "jaxformer/model/transformer.py",
             "                                kv_lengths=memory_lengths)", "                                kv_lengths=None)",
             (HF + "test_marian.py",), "EncoderDecoder.decode attends to the source's padding"),
    Mutation("engine_reserve_ignored", "jaxformer/decode/engine.py",
             'if (self.engine_options.reserve == "context"', 'if (False',
             ("tests/decode/test_engine.py",), "reserve='context' admits as the paged engine does (no baseline)"),
    Mutation("categorical_points_joined", "jaxformer/study/plots.py",
             'label=name, ls="none" if _categorical(sweep) else "-")', 'label=name, ls="-")',
             ("tests/study/test_sweep_tune.py",), "a categorical axis's points joined by lines"),
    # -- jaxformer serve: the real server process, driven over HTTP (tests/serve)
    Mutation("serve_utf8_split", "jaxformer/serve/text.py",
             "while end > start and full[end - 1] == REPLACEMENT:", "while False and full[end - 1] == REPLACEMENT:",
             ("tests/serve/test_run_dir.py",), "streamed deltas emit half a UTF-8 character (U+FFFD, never retracted)"),
    Mutation("serve_stop_returned", "jaxformer/serve/text.py",
             "return self._emit(full[:cut])", "return self._emit(full)",
             ("tests/serve/test_server.py",), "the stop string (and what follows it) is returned"),
    Mutation("serve_seed_not_offset", "jaxformer/serve/app.py",
             "top_p=sampling.top_p, seed=base + j,", "top_p=sampling.top_p, seed=base,",
             ("tests/serve/test_server.py",), "every choice samples with the request's seed, not seed + i"),
    Mutation("serve_cancel_ignored", "jaxformer/serve/worker.py",
             "if rid in self._active and self.engine.cancel(rid):", "if False:",
             ("tests/serve/test_server.py",), "a dropped stream's request runs on, holding its pages"),
    Mutation("serve_stop_drops_logprobs", "jaxformer/serve/app.py",
             "self.worker.cancel([st.rid], ended=True)", "self.worker.cancel([st.rid])",
             ("tests/serve/test_server.py",), "a choice a stop string ends is scored as a cancelled one: logprobs null"),
    Mutation("serve_chat_logprobs_keep_eos", "jaxformer/serve/app.py",
             "            if s.tokens and s.tokens[-1] in self.stop_tokens:\n                s = s[:-1]\n",
             "",
             ("tests/serve/test_text.py",), "chat logprobs list the turn's stop token as an empty token"),
    Mutation("serve_ignores_non_streamed_disconnect", "jaxformer/serve/app.py",
             "                    if await request.is_disconnected():\n                        return Response(status_code=499)\n",
             "", ("tests/serve/test_server.py",), "a non-streamed request runs on after its client hung up"),
    Mutation("incremental_decode_any_prefix", "jaxformer/serve/text.py",
             "            if self._read and self._decode(self.ids[self._read:]):",
             "            if self._read:",
             ("tests/serve/test_text.py",), "the incremental decode's prefix may decode to nothing (SentencePiece's "
             "stripped space lost)"),
    Mutation("base_never_rehashed", "jaxformer/train/lora.py",
             'if rec.get("stats") == file_stats(path):', "if True:",
             ("tests/train/test_lora.py",), "a changed LoRA base is taken as unchanged (never hashed again)"),
    Mutation("serve_logprobs_shifted", "jaxformer/decode/scoring.py",
             "chosen = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]",
             "chosen = jnp.take_along_axis(logp, tokens[0, :-1, None], axis=-1)[:, 0]",
             ("tests/serve/test_server.py",), "echo logprobs score each token where it is, not where it is predicted"),
]


def _copy_tree(dst: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
        else:
            shutil.copy2(src, dst / name)


def _pytest(work: Path, tests, timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONPATH=str(work), JAX_PLATFORMS="cpu", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider",
                               *tests], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    last = tail[-1] if tail else ""
    if proc.returncode == 0:
        return "survived", time.perf_counter() - t0, last
    if proc.returncode in (2, 3, 4):  # interrupted, internal error, usage error: not a test verdict
        return "error", time.perf_counter() - t0, last
    return "caught", time.perf_counter() - t0, last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutation names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (when it just passed)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.path:45s} {m.what}")
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutations: {sorted(unknown)}")

    for m in chosen:  # every mutation must still apply: exactly one match in today's code
        n = (ROOT / m.path).read_text().count(m.old)
        if n != 1:
            print(f"{m.name}: the text to mutate occurs {n} times in {m.path}; update the harness", file=sys.stderr)
            return 2

    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxformer-mutation-") as tmp:
        work = Path(tmp)
        _copy_tree(work)
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            verdict, secs, last = _pytest(work, tests, args.timeout * 3)
            print(f"baseline ({len(tests)} test files): {verdict} in {secs:.0f} s  {last}", flush=True)
            if verdict != "survived":
                print("the unmutated copy must pass its tests first", file=sys.stderr)
                return 2
        for m in chosen:
            target = work / m.path
            original = target.read_text()
            target.write_text(original.replace(m.old, m.new))
            try:
                compile(target.read_text(), str(target), "exec")
                verdict, secs, last = _pytest(work, m.tests, args.timeout)
            except SyntaxError as e:
                verdict, secs, last = "error", 0.0, f"mutation does not compile: {e}"
            finally:
                target.write_text(original)
            rows.append((m, verdict, secs))
            print(f"{m.name:28s} {verdict:9s} {secs:6.1f} s  {last}", flush=True)

    caught = sum(v == "caught" for _, v, _ in rows)
    lines = ["| mutation | file | what | tests run | verdict | seconds |", "|---|---|---|---|---|---|"]
    for m, v, s in rows:
        tests = ", ".join(Path(t).name for t in m.tests)
        lines.append(f"| `{m.name}` | `{m.path}` | {m.what} | {tests} | **{v}** | {s:.0f} |")
    lines.append(f"\n{caught} of {len(rows)} caught ({100 * caught / max(len(rows), 1):.0f}%).")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(f"# Mutation check\n\n`{' '.join(['python', 'experiments/mutation.py'] + (argv or sys.argv[1:]))}`\n\n"
                                  + table + "\n")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
