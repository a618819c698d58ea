"""Hugging Face checkpoints on the command line: generate / eval --hf, fine-tuning from model: {hf: DIR}, export.

Every checkpoint is a tiny random Llama written by jaxformer (``conftest.hf_llama_dir``); a run trains 3 steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.cli import main
from jaxformer.interop import load_pretrained, load_tokenizer
from jaxformer.model import apply
from jaxformer.train import config as C
from jaxformer.train.metrics import read_metrics
from jaxformer.train.run_dir import load_run
from tests.interop.hf_dirs import EOS, token_id, with_likely_eos
from tests.train.helpers import make_corpus, tiny_raw, write_config

TEXT = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the warm sun!\n"


def _same_params(a, b) -> None:
    """Two parameter trees (pure dicts) hold the same arrays, bit for bit."""
    ours, theirs = _flat(a), _flat(b)
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(theirs[k], ours[k], err_msg=k)


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# -- generate --hf

def test_generate_hf_samples_through_the_engine_and_stops_at_eos(hf_llama_dir, tmp_path, capsys):
    # one sequence at a time, both calls' engines of max_context 66 ("Hello" is 6 tokens, + 60; "The quick" 3, + 63):
    # one prefill and one decode step compiled for both (batches of 4, 2 and 1 and a narrower table compiled six). The
    # batched engine after the same run_prompts: tests/test_cli.py's --prompts-file and two-prompt generate tests
    ckpt = with_likely_eos(hf_llama_dir, tmp_path / "eos")
    tok = load_tokenizer(ckpt)
    eos = token_id(ckpt, EOS)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick\nA lazy dog\nHello\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--hf", str(ckpt), "--prompts-file", str(prompts), "--output", str(out),
                 "--max-new-tokens", "60", "--seed", "1", "--num-pages", "40", "--max-batch", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3
    for r in rows:  # prompts encoded as the checkpoint's tokenizer does (BOS first); sampling ends at its EOS
        assert r["error"] is None and r["num_prompt_tokens"] == len(tok.encode_prompt(r["prompt"]))
        assert r["stopped_by"] == "stop_token" and r["tokens"][-1] == eos and len(r["tokens"]) < 60
        assert r["completion"] == tok.decode(r["tokens"][:-1])
    assert any(r["completion"] for r in rows)
    capsys.readouterr()
    assert main(["generate", "--hf", str(ckpt), "--prompt", "The quick", "--max-new-tokens", "63", "--seed", "1",
                 "--num-pages", "40", "--max-batch", "1"]) == 0  # the same engine sizes: its compiled steps are reused
    assert capsys.readouterr().out == "The quick" + rows[0]["completion"] + "\n"


def test_generate_hf_notes_the_models_own_window_only_past_its_context(tmp_path, capsys):
    """Mistral (a 4-token sliding window, a 64-token context): 50 new tokens after the 5-token prompt stay inside the
    context, no note; 80 go past it, and the note says so once. Both engines hold 4 pages of 16 per sequence, so
    the second reuses the first's compiled steps."""
    from tests.interop.common import FIXTURES

    capsys.readouterr()
    args = ["generate", "--hf", str(FIXTURES / "mistral"), "--prompt", "the cat", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "50"]) == 0
    assert capsys.readouterr().err == ""
    assert main([*args, "--max-new-tokens", "80"]) == 0
    assert capsys.readouterr().err == ("note: generated past the model's 64-token context with a sliding 4-token "
                                       "window (each new token sees the last 4 positions)\n")


@pytest.mark.parametrize("model_type,kind", [("bert", "an encoder model"), ("marian", "an encoder-decoder model")])
def test_generate_hf_refuses_encoder_checkpoints(model_type, kind, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"is a {model_type} checkpoint, {kind}; generate needs a decoder-only (causal LM) checkpoint" in err
    assert main(["generate", str(tmp_path), "--hf", str(tmp_path), "--prompt", "hi"]) == 2
    assert "give a run directory or --hf DIR (a Hugging Face checkpoint), not both" in capsys.readouterr().err


# -- translate --hf (the committed Marian fixture)

def test_translate_hf_greedy_and_beam_equal_the_decode_functions(capsys):
    from jaxformer.decode.translate import TranslationConfig, beam_translate, greedy_translate
    from jaxformer.interop.marian import translation_kwargs
    from tests.interop.common import FIXTURES

    ckpt = FIXTURES / "marian"
    if not (ckpt / "config.json").is_file():
        pytest.skip("the marian fixture is missing")
    texts = ["The quick brown fox", "jumps over the lazy dog."]
    src_tok, tgt_tok = load_tokenizer(ckpt, side="source"), load_tokenizer(ckpt, side="target")
    rows = [src_tok.encode_prompt(t) for t in texts]
    kw = translation_kwargs(ckpt, beam=True)
    src = np.full((2, max(map(len, rows))), kw["pad_id"], np.int32)
    for i, r in enumerate(rows):
        src[i, :len(r)] = r
    lengths = np.asarray([len(r) for r in rows], np.int32)
    _, graphdef, state = load_pretrained(ckpt)
    model = nnx.merge(graphdef, state)
    greedy = greedy_translate(model, src, lengths,
                              config=TranslationConfig(**{**translation_kwargs(ckpt), "max_new_tokens": 8}))
    beam = beam_translate(model, src, lengths, config=TranslationConfig(**{**kw, "max_new_tokens": 8, "num_beams": 3}))
    capsys.readouterr()
    for extra, ids in (([], greedy), (["--beams", "3"], beam)):
        assert main(["translate", "--hf", str(ckpt), "--text", texts[0], "--text", texts[1],
                     "--max-new-tokens", "8", *extra]) == 0
        assert capsys.readouterr().out == "".join(tgt_tok.decode(r[1:]) + "\n" for r in ids)


# -- eval --hf

def test_eval_hf_loss_and_bits_per_byte_equal_a_direct_computation(hf_llama_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--hf", str(hf_llama_dir), "--text", str(text), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "--hf", str(hf_llama_dir), "--text", str(text)]) == 0  # readable unless --json
    assert capsys.readouterr().out.startswith(f"eval: loss {out['loss']:.4f} nats/token over {out['tokens']:,} "
                                              f"tokens · {out['bpb']:.4f} bits/byte over {out['bytes']:,} bytes\n")

    config, graphdef, state = load_pretrained(hf_llama_dir)
    tok = load_tokenizer(hf_llama_dir)
    ids = np.asarray([tok.bos_id, *tok.encode(TEXT)], np.int32)
    assert len(ids) <= config.max_seq_len  # one window: every token after BOS scored once
    logits = jax.jit(apply, static_argnums=0)(graphdef, state, jnp.asarray(ids[None, :-1]))[0]
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, jnp.asarray(ids[1:, None]), -1)[:, 0]
    nats = float(jnp.sum(nll))
    n_bytes = len(TEXT.encode("utf-8"))  # byte-level BPE: the scored tokens are the whole text
    assert out["tokens"] == len(ids) - 1 and out["bytes"] == n_bytes == out["text_bytes"]
    assert out["loss"] == pytest.approx(nats / (len(ids) - 1), rel=1e-5)
    assert out["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert main(["eval", "--hf", str(hf_llama_dir)]) == 2
    assert "eval --hf DIR needs --text FILE" in capsys.readouterr().err


# -- fine-tuning from model: {hf: DIR}, resume, export

@pytest.fixture(scope="module")
def finetuned(hf_llama_dir, tmp_path_factory):
    """3 steps of `jaxformer train` from a copy of the checkpoint, named by a path relative to the YAML file."""
    tmp = tmp_path_factory.mktemp("ft")
    ckpt = Path(shutil.copytree(hf_llama_dir, tmp / "ckpt" / "tiny-llama"))
    raw = tiny_raw(make_corpus(tmp / "corpus"), steps=3, checkpoint={"every": 3, "keep": 5})
    raw["model"] = {"hf": "../ckpt/tiny-llama", "remat": True}
    (tmp / "configs").mkdir()
    cfg = write_config(tmp / "configs" / "ft.yaml", raw)
    run = tmp / "run"
    code = main(["train", str(cfg), "--run-dir", str(run)])
    return cfg, ckpt, run, code


def test_finetune_starts_from_the_checkpoint_and_keeps_its_source(finetuned):
    from jaxformer.train.corpus import build_corpus
    from jaxformer.train.loop import _train_iterator

    cfg_path, ckpt, run, code = finetuned
    assert code == 0
    cfg = C.load(run / "config.yaml")
    assert cfg.hf_source == str(ckpt.absolute()) and cfg.data.tokenizer == "hf" and cfg.model.remat
    assert sorted(p.name for p in (run / "hf_source").iterdir()) == ["config.json", "tokenizer.json",
                                                                   "tokenizer_config.json"]
    # the loss of step 1 is the checkpoint's own loss on the first batch (the params before the first update)
    config, graphdef, state = load_pretrained(ckpt)
    assert config == cfg.model.model_copy(update={"remat": False})
    batch = next(_train_iterator(cfg, build_corpus(cfg.data, tokenizer_path=ckpt)))
    logits = jax.jit(apply, static_argnums=0)(graphdef, state, jnp.asarray(batch.tokens),
                                              positions=jnp.asarray(batch.positions),
                                              segment_ids=jnp.asarray(batch.segment_ids))
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, jnp.asarray(batch.targets)[..., None], -1)[
        ..., 0]
    mask = batch.loss_mask
    first = float(jnp.sum(jnp.where(mask, nll, 0.0)) / mask.sum())
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert rows[-1]["loss"] != rows[0]["loss"]


def test_finetune_resumes_without_the_checkpoint_and_exports_exactly(finetuned, tmp_path, capsys):
    cfg_path, ckpt, run, _ = finetuned
    tmp_run = tmp_path / "run"
    shutil.copytree(run, tmp_run)
    moved = ckpt.with_name("moved-away")
    os.rename(ckpt, moved)  # the weights are read at step 0 only: a resume needs the run directory alone
    try:
        capsys.readouterr()
        assert main(["train", str(tmp_run / "config.yaml"), "--run-dir", str(tmp_run), "--steps", "4",
                     "checkpoint.every=1"]) == 0
        assert "resuming at step 3" in capsys.readouterr().out
        assert [r["step"] for r in read_metrics(tmp_run) if "loss" in r] == [1, 2, 3, 4]

        out = tmp_path / "export"
        assert main(["export", str(tmp_run), "--hf", str(out)]) == 0
        assert f"exported step 4 of {tmp_run} as a llama checkpoint: {out}" in capsys.readouterr().out
    finally:
        os.rename(moved, ckpt)
    _, _, params, _, meta = load_run(tmp_run)
    assert meta["step"] == 4
    _, _, state = load_pretrained(out)
    _same_params(params, nnx.to_pure_dict(state))
    original = json.loads((ckpt / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "architectures", "model_type"):  # the original's keys survive
        assert exported[key] == original[key]
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert list(load_tokenizer(out).encode_prompt(TEXT)) == list(load_tokenizer(ckpt).encode_prompt(TEXT))


# -- bad input

def test_model_hf_errors_name_the_file_and_key(hf_llama_dir, tmp_path, capsys):
    raw = tiny_raw(make_corpus(tmp_path / "corpus", n_files=4))
    raw["model"] = {"hf": "missing_dir"}
    cfg = write_config(tmp_path / "bad.yaml", raw)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: model.hf: {tmp_path / 'missing_dir'}: not a directory" in err
    assert not (tmp_path / "r").exists()

    raw["model"] = {"hf": str(hf_llama_dir), "n_layers": 3}
    assert main(["train", str(write_config(cfg, raw))]) == 2
    assert f"{cfg}: model.n_layers: is fixed by the checkpoint's config.json (model.hf)" in capsys.readouterr().err
    # the attention section: impl may be set, nothing else; a flat key of before the sections is refused too
    ok = C.from_dict({**raw, "model": {"hf": str(hf_llama_dir), "attention": {"impl": "xla"}}}, str(cfg))
    assert ok.model.attention.impl == "xla"
    assert C.from_dict({**raw, "model": {"hf": str(hf_llama_dir), "attention_impl": "xla"}}, str(cfg)) == ok
    for model, key in (({"attention": {"impl": "xla", "n_heads": 2}}, "model.attention.n_heads"),
                       ({"n_heads": 2}, "model.n_heads")):
        with pytest.raises(C.ConfigError, match=rf"{key}: is fixed by the checkpoint's config.json"):
            C.from_dict({**raw, "model": {"hf": str(hf_llama_dir), **model}}, str(cfg))

    raw["model"] = {"hf": str(hf_llama_dir)}
    raw["data"]["tokenizer"] = "bpe"
    assert main(["train", str(write_config(cfg, raw))]) == 2
    assert ("data.tokenizer='bpe' conflicts with model.hf: a checkpoint is trained on with its own tokenizer; "
            "leave data.tokenizer unset or set it to 'hf'") in capsys.readouterr().err


def test_export_of_a_run_trained_from_scratch(finetuned, tmp_path, capsys):
    """A from-scratch BPE run of the same architecture (its compiled train step is the fine-tune's): the
    export loads back with the run's parameters and its tokenizer, special tokens named."""
    _, _, ft_run, _ = finetuned
    raw = tiny_raw(make_corpus(tmp_path / "corpus", n_files=8), steps=1, checkpoint={"every": 1},
                   data={"tokenizer": "bpe", "bpe_vocab_size": 300})
    raw["model"] = C.to_dict(C.load(ft_run / "config.yaml"))["model"]
    run = tmp_path / "run"
    assert main(["train", str(write_config(tmp_path / "bpe.yaml", raw)), "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "out")]) == 0
    _, _, params, tok, _ = load_run(run)
    _, _, state = load_pretrained(tmp_path / "out")
    _same_params(params, nnx.to_pure_dict(state))
    hf_tok = load_tokenizer(tmp_path / "out")
    assert (hf_tok.bos_id, hf_tok.eos_id, hf_tok.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert list(hf_tok.encode(TEXT)) == list(tok.encode(TEXT))


def test_export_of_a_model_no_family_expresses_is_refused(tmp_path, capsys):
    """Refused from the run's config.yaml, before any checkpoint is read (this run has none)."""
    raw = tiny_raw(tmp_path / "corpus")
    raw["model"]["activation"] = "gelu"  # a Llama MLP is SwiGLU
    C.dump(C.from_dict(raw), tmp_path / "run" / "config.yaml")
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxformer export: error: not expressible as a llama config.json: ffn.activation='gelu'"), err
    assert not (tmp_path / "out").exists()
