"""Record transformers' outputs on GGUF files for ``test_gguf.py`` (``tests/interop/fixtures/gguf/``).

1. ``smollm2.npz`` + ``smollm2.json``: SmolLM2-135M-Instruct (Q4_1; :mod:`tests.interop.gguf_reference`
   fetches it) loaded by transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``, which
   de-quantizes with the same ``gguf`` library and undoes llama.cpp's Q/K permutation), in float32 with
   eager attention. For each prompt of ``PROMPTS`` and each conversation of ``CHAT`` (rendered with
   ``apply_chat_template(..., add_generation_prompt=True)``): transformers' token ids, the logits of every
   position summarised (the top ``TOP_K`` ids and values, mean, std, logsumexp and ``PROJECTIONS``
   fixed +-1 projections over the whole 49,152-token vocabulary: kilobytes, not the 196 KB per position
   of the logits themselves), and ``generate(max_new_tokens=NEW_TOKENS, do_sample=False)`` with the
   top-1 minus top-2 margin of each greedy step. The JSON also records the rendered chat strings, which
   split rule reproduces transformers' ids (GPT-2's regex vs llama.cpp's digits-first ``smollm`` rule),
   the versions and the file's sha256.
2. ``spm_merges.gguf``, ``spm_scores.gguf`` + ``spm.json``: two tiny metadata-only GGUF files (written
   here with ``gguf.GGUFWriter``) with a SentencePiece-style vocabulary (``tokenizer.ggml.model = llama``:
   the ``llama`` fixture's 96 pieces, 256 ``<0xNN>`` byte pieces, a user-defined ``<think>``), one with
   ``tokenizer.ggml.merges``, one with only scores (merges rebuilt from them); and transformers' ids and
   decodings of ``SPM_TEXTS`` through ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.

Regenerate (from the repository root; a venv apart from the project's)::

    python3 -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers==5.24.0 gguf==0.19.0 accelerate tokenizers jinja2
    /tmp/fixenv/bin/python tests/interop/make_gguf_fixtures.py

Re-running with the same versions reproduces every file byte for byte. Not collected by pytest (the name
does not match ``test_*.py``); torch and transformers are imported only inside the functions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.interop import gguf_reference as ref  # noqa: E402
from tests.interop.make_fixtures import save_npz, write_json  # noqa: E402

OUT = Path(__file__).parent / "fixtures" / "gguf"
SPM_SOURCE = Path(__file__).parent / "fixtures" / "llama" / "tokenizer.json"
SPM_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "Zürich \u2603, 12 tick<think>tock",
    "hello<s>world</s> end",
)


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "gguf", "tokenizers", "jinja2", "numpy")}


def smollm2(out: Path) -> None:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = ref.fetch()
    kw = dict(gguf_file=file.name)
    tok = AutoTokenizer.from_pretrained(str(file.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), dtype=torch.float32, attn_implementation="eager",
                                                 **kw).eval()
    # llama.cpp's `smollm` rule: every digit apart, then GPT-2's regex (the SmolLM2 tokenizer.json's own)
    digits_first = type(tok.backend_tokenizer).from_str(tok.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False)])
    texts = list(ref.PROMPTS)
    chats = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in ref.CHAT]
    arrays, meta_prompts = {}, []
    for p, text in enumerate(texts + chats):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=ref.NEW_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        new = gen.sequences[0, len(ids):].numpy()
        steps = torch.stack(gen.scores)[:, 0].numpy()
        top2 = np.sort(steps, -1)[:, -2:]
        top_ids, top_values = ref.top_k(logits)
        arrays.update({f"p{p}_ids": np.asarray(ids, np.int64), f"p{p}_top_ids": top_ids,
                       f"p{p}_top_values": top_values, f"p{p}_summary": ref.summarize(logits),
                       f"p{p}_generated": new.astype(np.int64),
                       f"p{p}_margins": (top2[:, 1] - top2[:, 0]).astype(np.float32)})
        meta_prompts.append(dict(
            kind="plain" if p < len(texts) else "chat", text=text, num_tokens=len(ids),
            digits_first_ids_equal=digits_first.encode(text, add_special_tokens=False).ids == ids,
            continuation=tok.decode(new), min_margin=float((top2[:, 1] - top2[:, 0]).min()),
            logit_std_last=float(logits[-1].std())))
    save_npz(out / "smollm2.npz", arrays)
    split_case = "a  12"
    write_json(out / "smollm2.json", dict(
        file=ref.MEMBER, requirement=ref.REQUIREMENT, sha256=ref.SHA256, versions=versions(),
        load="AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32, "
             "attn_implementation='eager'); AutoTokenizer.from_pretrained(dir, gguf_file=...)",
        generate=f"generate(ids, max_new_tokens={ref.NEW_TOKENS}, do_sample=False) (stops at eos_token_id "
                 f"{model.generation_config.eos_token_id})",
        transformers_pre_tokenizer=str(tok.backend_tokenizer.pre_tokenizer),
        transformers_config={**{k: getattr(model.config, k) for k in (
            "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
            "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
            "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")},
            "rope_theta": model.config.rope_parameters["rope_theta"]},
        split_rule_example={"text": split_case, "transformers": tok(split_case)["input_ids"],
                            "digits_first": digits_first.encode(split_case, add_special_tokens=False).ids},
        chat=list(ref.CHAT), prompts=meta_prompts, top_k=ref.TOP_K, summary=list(ref.SUMMARY),
        arrays={k: [str(v.dtype), list(v.shape)] for k, v in sorted(arrays.items())}))


def spm_vocab() -> tuple[list[str], list[float], list[int], list[str]]:
    """``(tokens, scores, token types, merges)``: the ``llama`` fixture's BPE, 256 byte pieces, ``<think>``."""
    spec = json.loads(SPM_SOURCE.read_text())
    vocab = spec["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    assert [vocab[p] for p in pieces] == list(range(len(pieces)))
    tokens = pieces + [f"<0x{b:02X}>" for b in range(256)] + ["<think>"]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 1 for t in pieces] + [6] * 256 + [4]
    scores = [0.0 if k != 1 else -float(i) for i, k in enumerate(types)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return tokens, scores, types, merges


def write_spm_gguf(path: Path, *, with_merges: bool) -> None:
    import gguf

    tokens, scores, types, merges = spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-spm")
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if with_merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm(out: Path) -> None:
    from transformers import AutoTokenizer

    record = {}
    for name, with_merges in (("spm_merges", True), ("spm_scores", False)):
        file = out / f"{name}.gguf"
        write_spm_gguf(file, with_merges=with_merges)
        tok = AutoTokenizer.from_pretrained(str(out), gguf_file=file.name)
        rows = []
        for text in SPM_TEXTS:
            ids = tok(text)["input_ids"]
            plain = tok(text, add_special_tokens=False)["input_ids"]
            rows.append(dict(text=text, ids=ids, ids_no_specials=plain,
                             decoded=tok.decode(ids, skip_special_tokens=True)))
        record[name] = dict(file=file.name, texts=rows, bos=tok.bos_token, eos=tok.eos_token, unk=tok.unk_token)
    write_json(out / "spm.json", dict(versions=versions(), source="tests/interop/fixtures/llama/tokenizer.json",
                                      call="AutoTokenizer.from_pretrained(dir, gguf_file=...)", **record))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", default="smollm2,spm", help="comma-separated: smollm2, spm")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    if "spm" in only:
        spm(args.out)
    if "smollm2" in only:
        smollm2(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
