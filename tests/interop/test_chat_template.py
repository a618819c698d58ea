"""Chat templates rendered as transformers renders them (jaxformer.interop.tokenizer.render_chat_template),
against jinja2 itself on the same template with transformers' own additions spelled out."""

from __future__ import annotations

import jinja2
import pytest

from jaxformer.interop.tokenizer import render_chat_template

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <b>"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
            "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _plain(template: str, **kw) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(**kw)


def test_generation_blocks_render_their_body():
    """transformers' ``{% generation %}`` (it marks the assistant's tokens for training masks) renders as its
    body: the same text as the template without the tags."""
    without = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    for prompt in (False, True):
        got = render_chat_template(TEMPLATE, MESSAGES, add_generation_prompt=prompt, bos_token="<s>")
        assert got == _plain(without, messages=MESSAGES, add_generation_prompt=prompt, bos_token="<s>")
        assert got.count("yo<|end|>") == 1 and got.startswith("<s><|system|>\nbe brief")


def test_tojson_does_not_escape_html_and_raise_exception_raises():
    got = render_chat_template("{{ messages[1] | tojson }}", MESSAGES)
    assert got == '{"role": "user", "content": "hi <b>"}'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        render_chat_template("{{ raise_exception('no system role') }}", MESSAGES)


def test_a_checkpoints_template_file_is_read_before_tokenizer_config(tmp_path):
    """A checkpoint's ``chat_template.jinja`` (where recent transformers save it) is its template, before a
    ``chat_template`` in ``tokenizer_config.json`` (transformers' order); without either there is none."""
    import json
    import shutil
    from pathlib import Path

    from jaxformer.interop.tokenizer import load_tokenizer

    ckpt = shutil.copytree(Path(__file__).parent / "fixtures" / "llama3", tmp_path / "ckpt")
    assert load_tokenizer(ckpt).chat_template is None
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    in_config = "config: {{ messages[0].content }}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": in_config}))
    assert load_tokenizer(ckpt).chat_template == in_config
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    tok = load_tokenizer(ckpt)
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == render_chat_template(
        TEMPLATE, MESSAGES, add_generation_prompt=True, bos_token="<|begin_of_text|>")
