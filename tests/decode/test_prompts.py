"""run_prompts / prompts files / JSON lines: good requests match generate(), bad ones fail alone."""

import io
import json
from pathlib import Path

from jaxformer.decode.generate import generate
from jaxformer.decode.prompts import GenerateOptions, read_prompts_file, run_prompts, write_jsonl

GEOMETRY = dict(num_pages=10, page_size=4, max_batch=4, chunk_size=8)  # as test_engine: no new compile


class Bytes:
    """Byte tokenizer for a 256-token model, BOS = 0 (the NUL byte never appears in prompts)."""

    bos_id, eos_id = 0, None

    def encode(self, s):
        return list(s.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_run_prompts_records(llama):
    cfg, graphdef, state = llama
    prompts = ["hello", "", {"prompt": "abc", "temperature": -1}, {"prompt": "xy", "max_new_tokens": 3},
               "a" * 50, {"prompt": "q", "colour": 1}, {"error": "f:7: invalid JSON"}]
    recs = run_prompts(graphdef, state, cfg, Bytes(), prompts, GenerateOptions(max_new_tokens=5, temperature=0.0, **GEOMETRY))
    assert [r["index"] for r in recs] == list(range(7))
    errors = {i: r["error"] for i, r in enumerate(recs) if r["finish_reason"] == "error"}
    assert set(errors) == {1, 2, 4, 5, 6}
    assert "empty prompt" in errors[1] and "temperature" in errors[2] and "longer than" in errors[4]
    assert "unknown keys ['colour']" in errors[5] and "invalid JSON" in errors[6]
    for i, n in ((0, 5), (3, 3)):
        text = prompts[i] if isinstance(prompts[i], str) else prompts[i]["prompt"]
        want = generate(graphdef, state, cfg, [[0] + list(text.encode())], max_new_tokens=8)[0][:n]
        assert recs[i]["tokens"] == want and recs[i]["finish_reason"] == "length"
        assert recs[i]["completion"] == Bytes().decode(want)
        assert recs[i]["num_prompt_tokens"] == len(text) + 1


def test_completions_of_a_sentencepiece_model_keep_the_space_before_their_first_word():
    """The Mistral fixture (a Metaspace tokenizer, as Llama-2's and Mistral's): what ``jaxformer generate`` prints,
    prompt + completion, is the prompt's and the generated tokens' text decoded together; decoded alone the
    completion dropped its first space (10 of these 24 sampled records before the fix: "abcd" for "ab cd")."""
    from jaxformer.interop.hf import load_pretrained
    from jaxformer.interop.tokenizer import load_tokenizer

    fixture = Path(__file__).resolve().parents[1] / "interop" / "fixtures" / "mistral"
    cfg, graphdef, state = load_pretrained(fixture)
    tok = load_tokenizer(fixture)
    prompts = ["xo ju", "ab", "the", "x y z", "in4!", "bck", "Apun", "o"] * 3
    recs = run_prompts(graphdef, state, cfg, tok, prompts,
                       GenerateOptions(max_new_tokens=3, temperature=2.0, seed=11))
    starts_a_word = 0
    for r in recs:
        ids = [int(t) for t in tok.encode_prompt(r["prompt"])] + [t for t in r["tokens"] if t != tok.eos_id]
        assert r["prompt"] + r["completion"] == tok.decode(ids), r
        starts_a_word += r["completion"].startswith(" ")
    assert starts_a_word >= 5  # the case the fix is for is among them
    # the training loop's eval.sample (sample_text) the same way
    from types import SimpleNamespace

    from jaxformer.train import config as C
    from jaxformer.train.loop import sample_text

    trainer = SimpleNamespace(spec=SimpleNamespace(model=cfg), graphdef=graphdef)
    texts = []
    for seed in range(8):
        sample = C.SampleConfig(prompt="ab", max_new_tokens=3, temperature=2.0)
        texts.append(sample_text(trainer, state, tok, sample, seed))
        ids = [int(t) for t in tok.encode_prompt("ab")]
        out = generate(graphdef, state, cfg, [ids], max_new_tokens=3, temperature=2.0, seed=seed,
                       stop_tokens=[tok.eos_id])[0]
        assert texts[-1] == tok.decode(ids + out), (seed, texts[-1])
    assert any(t.startswith("ab ") for t in texts), texts  # seed 7's continuation starts a word


def test_prompts_file_and_jsonl(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('plain text line\n\n{"prompt": "json", "top_k": 3}\n{not json\n', encoding="utf-8")
    items = read_prompts_file(path)
    assert items[0] == "plain text line" and items[1] == {"prompt": "json", "top_k": 3}
    assert "invalid JSON" in items[2]["error"] and ":4:" in items[2]["error"]
    path.write_text('{"prompt": "json", "top_k": 3}\nplain\n', encoding="utf-8-sig")  # a BOM (Notepad, PowerShell)
    assert read_prompts_file(path) == [{"prompt": "json", "top_k": 3}, "plain"]
    buf = io.StringIO()
    write_jsonl([{"a": 1}, {"b": "é"}], buf)
    assert [json.loads(x) for x in buf.getvalue().splitlines()] == [{"a": 1}, {"b": "é"}]
    write_jsonl([{"a": 1}], tmp_path / "out.jsonl")
    assert json.loads((tmp_path / "out.jsonl").read_text()) == {"a": 1}
