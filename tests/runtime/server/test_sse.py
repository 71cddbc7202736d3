"""Server-sent events survive every way clients split lines."""

from __future__ import annotations

import json

from kubellm.runtime.server.openai_routes import sse_event


def test_an_event_is_one_line_even_when_the_text_holds_unicode_line_breaks():
    text = "a\x85b\u2028c\u2029d\ne\rf\x1cg\x0bh — 東京"
    event = sse_event({"choices": [{"text": text}]})
    assert event.endswith("\n\n") and event.startswith("data: ")
    line = event[: -2]
    assert line.splitlines() == [line]  # what httpx's iter_lines and str.splitlines-based clients do
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text
    assert "東京" in line  # non-ASCII stays UTF-8, not \u escapes
