"""Output cleaning and bounding (pure functions; no processes)."""

from __future__ import annotations

from rolloutd.tools._text import OutputCollector, TextCollector, clean, elide, strip_ansi
from rolloutd.tools.bash import ansi_c_quote


def test_strip_ansi_and_clean() -> None:
    assert strip_ansi("\x1b[1;31mred\x1b[0m \x1b]0;title\x07x \x1b[?2004h") == "red x "
    assert clean("a\r\nb\x00c\x07\rdone\n") == "a\ndone\n"
    assert clean("50%\r100%\n") == "100%\n"
    assert clean("tab\there\n") == "tab\there\n"


def test_utf8_split_across_feeds_and_invalid_bytes() -> None:
    c = OutputCollector()
    data = "é€😀".encode()
    for i in range(len(data)):
        c.feed(data[i:i + 1])
    c.feed(b"\xff!")
    assert c.render(100) == "é€😀\ufffd!"


def test_head_and_tail_are_bounded() -> None:
    c = OutputCollector(head_bytes=1000, tail_bytes=1000)
    c.feed(b"H" * 1000)
    for _ in range(1000):
        c.feed(b"m" * 10_000)
    c.feed(b"T" * 1000)
    out = c.render(600)
    assert out.startswith("H" * 300) and out.endswith("T" * 300)
    assert "omitted from the middle" in out
    assert len(out) < 800
    assert c.total_bytes == 10_002_000


def test_elide_and_text_collector() -> None:
    assert elide("abc", 10) == "abc"
    out = elide("a" * 50 + "b" * 50, 20)
    assert out.startswith("a" * 10) and out.endswith("b" * 10) and "80 characters" in out
    t = TextCollector(head_chars=10, tail_chars=10)
    for _ in range(100):
        t.feed("0123456789")
    assert "characters omitted" in t.render(30)
    t.clear()
    t.feed("x")
    assert t.render(30) == "x"


def test_ansi_c_quote_is_safe_to_type() -> None:
    q = ansi_c_quote("echo 'hi'\n\tx\\y\x03é")
    assert q == "$'echo \\'hi\\'\\n\\tx\\\\y\\x03\\xc3\\xa9'"
    assert all(32 <= ord(ch) < 127 for ch in q)
