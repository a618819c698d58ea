"""TextStream: deltas that concatenate to the decoded text, never half a UTF-8 character, stop strings cut
before they start (no server, no model: a byte tokenizer's decode); the incremental decoding under them equals
decoding everything on the committed fixtures' real tokenizers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from jaxformer.serve.text import IncrementalDecode, TextStream, prefix_lengths

EOS = 300


def decode(ids) -> str:  # raw bytes, as jaxformer's byte tokenizer and a byte-level BPE decode
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def feed(stream: TextStream, ids, step: int = 1) -> list[str]:
    deltas = [stream.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas + [stream.finish()]


@pytest.mark.parametrize("text", ["h\u00e9llo \u20ac 12 \U0001f600!", "\u00e9", "\u4e2d\u6587\u5b57", "plain"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_concatenate_to_the_text_and_hold_no_half_character(text, step):
    ids = list(text.encode("utf-8"))
    deltas = feed(TextStream(decode), ids, step)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never the replacement of a character not yet complete


def test_invalid_bytes_come_out_once_a_later_character_shows_they_were_real():
    ids = [0xC3, ord("a"), 0xE2, 0x82]  # a lone lead byte, then an unfinished euro sign at the end
    s = TextStream(decode)
    assert s.add(ids[:1]) == ""  # could still become a character
    assert s.add(ids[1:2]) == "\ufffda"
    assert s.add(ids[2:]) == ""
    assert s.finish() == "\ufffd"  # the request ended: what is left is what the bytes decode to
    assert s.text == decode(ids)


def test_random_byte_streams_concatenate_to_their_decoding():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(256), rng.randrange(0x80, 0x100)]) for _ in range(rng.randrange(1, 30))]
        deltas = feed(TextStream(decode), ids, rng.randrange(1, 4))
        assert "".join(deltas) == decode(ids)


def test_a_stop_string_ends_the_text_before_it_even_split_over_tokens():
    ids = list(b"say hello world")
    s = TextStream(decode, stop=["lo w", "xyz"])
    deltas = [s.add([t]) for t in ids]
    assert "".join(deltas) == "say hel" and s.stopped and s.text == "say hel"
    assert s.num_tokens == len(b"say hello w")  # up to the token that completed the stop string
    assert s.add(list(b"more")) == "" and s.finish() == "" and s.num_tokens == len(b"say hello w")


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot():
    s = TextStream(decode, stop=["abc"])
    assert s.add(list(b"xa")) == "x"
    assert s.add(list(b"b")) == ""
    assert s.add(list(b"d")) == "abd"  # not the stop string after all
    assert s.add(list(b"ab")) == "" and s.finish() == "ab" and not s.stopped


def test_earliest_stop_wins_and_skipped_tokens_are_counted_not_decoded():
    s = TextStream(decode, stop=["cd", "b"], skip=[EOS])
    assert s.add([ord("a"), EOS, ord("b"), ord("c"), ord("d")]) == "a" and s.stopped and s.num_tokens == 3
    t = TextStream(decode, skip=[EOS])
    assert t.add([ord("a"), EOS]) == "a" and t.finish() == "" and t.num_tokens == 2


def test_a_stop_string_inside_one_token():
    s = TextStream(lambda ids: "".join({1: "one", 2: " two three", 3: " four"}[i] for i in ids), stop=["o t"])
    assert s.add([1]) == "one"
    assert s.add([2, 3]) == " tw" and s.stopped and s.num_tokens == 2


FIXTURES = Path(__file__).resolve().parents[1] / "interop" / "fixtures"


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "spm_gguf"])
def test_incremental_decode_equals_decoding_everything_on_real_tokenizers(name):
    """Byte-level BPE (gpt2), SentencePiece-style BPE with a leading-space strip (llama, mistral) and a GGUF
    SentencePiece vocabulary: after every token, the incremental text is ``decode(all tokens so far)``
    exactly, random ids (specials and half characters included) and the tokens of a multilingual text."""
    from jaxformer.interop.tokenizer import load_tokenizer

    tok = load_tokenizer(FIXTURES / "gguf" / "spm_scores.gguf" if name == "spm_gguf" else FIXTURES / name)
    rng = random.Random(0)
    texts = ["héllo wörld — 東京 🙂 def f(x):\n    return x", " leading space", "a\n\n b"]
    sequences = [tok.encode(t) for t in texts] + [[rng.randrange(tok.vocab_size) for _ in range(40)]
                                                 for _ in range(20)]
    for ids in sequences:
        d = IncrementalDecode(tok.decode)
        for k, t in enumerate(ids, 1):
            assert d.push(t) == tok.decode(ids[:k]), (name, ids[:k])
        assert prefix_lengths(tok.decode, ids) == [len(tok.decode(ids[:k])) for k in range(len(ids))]


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "spm_gguf"])
def test_a_completion_decoded_after_its_prompt_keeps_its_first_space(name):
    """A SentencePiece decoder (llama, mistral, the GGUF vocabulary) drops the first space of what it decodes, so
    a completion decoded alone lost the space before its first word (``"ab" + "cd"``): decoded after the
    prompt's last tokens, prompt + completion is the prompt's and completion's tokens decoded together, in the
    stream (token by token), in one piece (``decode_completion``) and in the logprobs' offsets; a byte-level BPE
    (gpt2) the same as before."""
    import numpy as np

    from jaxformer.decode.prompts import completion_context, decode_completion
    from jaxformer.decode.scoring import TokenLogprobs
    from jaxformer.interop.tokenizer import load_tokenizer
    from jaxformer.serve import protocol as P
    from jaxformer.serve.app import Service, _State

    tok = load_tokenizer(FIXTURES / "gguf" / "spm_scores.gguf" if name == "spm_gguf" else FIXTURES / name)
    service = object.__new__(Service)  # only what the text needs: the tokenizer and the stop tokens
    service.tok, service.stop_tokens, service._pieces = tok, (tok.eos_id,), {}
    checked = 0
    for prompt, whole in [("ab", "ab cd ef"), ("the", "the tin l1"), ("ab c", "ab cd ef")]:
        p, full = ([int(t) for t in tok.encode_prompt(x)] for x in (prompt, whole))
        if full[:len(p)] != p:  # the prompt's tokens are not the text's first ones: no continuation to check
            continue
        gen, ctx = full[len(p):], completion_context(tok.decode, p)
        stream = service.text_stream(p)  # what the server streams (its stop tokens not text)
        text = "".join(stream.add([t]) for t in gen) + stream.finish()
        assert prompt + text == tok.decode(full) == prompt + decode_completion(tok.decode, ctx, gen), (name, prompt)
        assert prefix_lengths(tok.decode, gen, ctx) == [len(decode_completion(tok.decode, ctx, gen[:k]))
                                                        for k in range(len(gen))]
        n = len(p) + len(gen) - 1  # the server's logprobs: each generated token's offset in the returned text
        scores = TokenLogprobs(-np.ones(n), np.zeros((n, 1), np.int32), -np.ones((n, 1)))
        st = _State(0, 0, p, prompt, stream, tokens=gen, finish_reason="length", scores=scores)
        sampling = P.parse_sampling({"prompt": prompt, "logprobs": 1}, chat=False)
        assert service.logprobs(st, sampling, False, 0, len(gen), False)["text_offset"] == [
            len(decode_completion(tok.decode, ctx, gen[:k])) for k in range(len(gen))]
        checked += 1
    assert checked >= 2, name
    rng = random.Random(1)  # random ids after a prompt: the incremental text is decode_completion's at every step
    for _ in range(10):
        p, ids = ([rng.randrange(tok.vocab_size) for _ in range(n)] for n in (5, 30))
        ctx = completion_context(tok.decode, p)
        d = IncrementalDecode(tok.decode, ctx)
        for k, t in enumerate(ids, 1):
            assert d.push(t) == decode_completion(tok.decode, ctx, ids[:k]), (name, p, ids[:k])


def test_chat_logprobs_leave_out_the_turns_stop_token():
    """A chat answer that ended on its stop token (EOS: generated, never text) has no logprobs entry for that
    token (OpenAI's chat logprobs cover the message's content); every token before it has one."""
    import numpy as np

    from jaxformer.decode.scoring import TokenLogprobs
    from jaxformer.serve import protocol as P
    from jaxformer.serve.app import Service, _State

    class Bytes:
        def decode(self, ids):
            return decode(ids)

    service = object.__new__(Service)  # only what logprobs needs: the tokenizer, the stop tokens
    service.tok, service.stop_tokens, service._pieces = Bytes(), (EOS,), {}
    prompt, answer = list(b"hi"), list(b"ok") + [EOS]
    stream = TextStream(decode, skip=(EOS,))
    stream.add(answer)
    stream.finish()
    n = len(prompt) + len(answer) - 1
    rng = np.random.default_rng(0)
    scores = TokenLogprobs(-rng.random(n), np.zeros((n, 1), np.int32) + ord("o"), -rng.random((n, 1)))
    st = _State(0, 0, prompt, "hi", stream, tokens=answer, finish_reason="stop", scores=scores)
    sampling = P.parse_sampling({"messages": [], "logprobs": True, "top_logprobs": 1}, chat=True)
    content = service.logprobs(st, sampling, True, 0, stream.num_tokens, False)["content"]
    assert stream.num_tokens == 3 and [e["token"] for e in content] == ["o", "k"]
    assert [e["logprob"] for e in content] == scores.logprobs[len(prompt) - 1:len(prompt) + 1].tolist()


@pytest.mark.parametrize("field, value, inert", [
    ("min_p", 0.9, 0.0), ("repetition_penalty", 1.3, 1.0), ("ignore_eos", True, False), ("min_tokens", 4, 0),
    ("stop_token_ids", [7], []), ("tool_choice", "required", "auto"), ("presence_penalty", 0.5, 0),
    ("guided_json", {"type": "object"}, None), ("skip_special_tokens", False, True)])
def test_a_field_that_would_change_the_answer_is_refused_and_its_default_ignored(field, value, inert):
    """A field the server does not implement (OpenAI's, or an extension of vLLM's that harnesses send) is a 400
    naming it when its value would change the answer, not an answer that silently ignored it."""
    from jaxformer.serve import protocol as P

    with pytest.raises(P.APIError, match=f"^{field}: not supported by this server") as e:
        P.parse_sampling({"prompt": "x", field: value}, chat=False)
    assert e.value.status == 400 and e.value.param == field
    assert P.parse_sampling({"prompt": "x", field: inert}, chat=False).n == 1


@pytest.mark.parametrize("name", ["byte_level", "gpt2", "llama", "mistral", "spm_gguf", "bytes"])
def test_chat_logprobs_bytes_are_each_tokens_own_even_a_part_of_a_character(name, tmp_path):
    """OpenAI's ``bytes`` let a client rebuild text token by token: a token holding part of a character carries
    its own bytes, not the U+FFFD its text decodes to; joined, the bytes are the text's UTF-8 (a SentencePiece
    vocabulary's leading space included). A byte-level BPE of every byte and no merge (made here: each non-ASCII
    character spans several tokens), the fixtures' (gpt2's byte-level; llama, mistral, the GGUF one
    SentencePiece: ASCII only in their small vocabularies) and jaxformer's byte tokenizer."""
    import json

    from jaxformer.interop.tokenizer import load_tokenizer
    from jaxformer.serve import protocol as P
    from jaxformer.serve.app import Service
    from jaxformer.train.tokenizers import ByteTokenizer

    if name == "bytes":
        tok = ByteTokenizer()
    elif name == "byte_level":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        t = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        t.add_tokens(["\n\n"])  # an added token that is text (not special), stored as it, not in the byte alphabet
        t.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
        tok = load_tokenizer(tmp_path)
    else:
        tok = load_tokenizer(FIXTURES / "gguf" / "spm_scores.gguf" if name == "spm_gguf" else FIXTURES / name)
    service = object.__new__(Service)  # what the logprobs need: the tokenizer and its pieces' cache
    service.tok, service._pieces = tok, {}
    checked = []
    for text in ["\u00e9\u20ac \u6771\u4eac \U0001f642", "ab cd", "the tin"]:
        ids = [int(i) for i in tok.encode(text)]
        if tok.decode(ids) != text:  # the fixture's small vocabulary cannot spell it
            continue
        s = P.Scored(ids, [-0.1] * len(ids), [[(i, -0.2)] for i in ids])
        out = P.chat_logprobs(s, service.piece, 1, service.piece_bytes)  # as the server calls it
        joined = b"".join(bytes(e["bytes"]) for e in out["content"])
        assert joined.decode("utf-8") in (text, " " + text), (name, joined)
        if text.isascii():  # whole characters: each token reads as its bytes do (a SentencePiece piece's space too)
            assert "".join(e["token"] for e in out["content"]) == joined.decode("utf-8"), name
        assert [e["top_logprobs"][0]["bytes"] for e in out["content"]] == [e["bytes"] for e in out["content"]]
        checked.append(text)
    assert len(checked) >= 2 and (name not in ("byte_level", "bytes") or not checked[0].isascii()), (name, checked)
    if name == "bytes":
        assert tok.piece_bytes(0xC3) == b"\xc3" and tok.piece_bytes(tok.eos_id) == b""
    if name == "byte_level":
        (nl,) = tok.encode("\n\n")
        assert tok.piece_bytes(int(nl)) == b"\n\n" == tok.decode([nl]).encode()
        assert tok.token_bytes[int(nl)] == 2  # bits per byte count it as its two bytes (was 0: no byte alphabet)


def test_a_prompt_of_no_tokens_is_a_400_naming_the_field():
    """Text that a tokenizer without BOS cannot spell encodes to no tokens: a bad request (400 at the prompt's
    field), not the engine's "empty prompt" answered as a 500."""
    from jaxformer.serve import protocol as P
    from jaxformer.serve.app import Service

    service = object.__new__(Service)  # max_new reads only the limits before it finds the prompt empty
    service.page_size, service.max_context = 4, 64
    sampling = P.parse_sampling({"prompt": "x"}, chat=False)
    with pytest.raises(P.APIError, match="the prompt encodes to no tokens") as e:
        service.max_new([], sampling, "prompt")
    assert e.value.status == 400 and e.value.param == "prompt"
