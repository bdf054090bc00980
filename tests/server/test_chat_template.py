"""``--chat-template`` and ``--chat-template-content-format`` resolution, without a server."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.openai.chat_template import load_chat_template, resolve_content_format


def test_chat_template_is_a_file_or_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (None, "string"),
    ],
)
def test_auto_content_format_follows_the_template(template, expected):
    assert resolve_content_format("auto", template) == expected
    assert resolve_content_format("openai", template) == "openai"
    assert resolve_content_format("string", template) == "string"
    with pytest.raises(ValueError, match="--chat-template-content-format"):
        resolve_content_format("list", template)
