"""Turning raw process output into text a model can read.

- :class:`OutputCollector` keeps a bounded head and tail of a byte stream (``yes`` cannot
  exhaust memory) and counts what it dropped in between.
- :func:`clean` strips ANSI/OSC escapes, resolves ``\\r`` progress lines, drops NULs and other
  control characters.
- :func:`elide` cuts a long text to head + tail characters with an explicit note.

UTF-8 is decoded incrementally with ``errors="replace"``: a multi-byte character split across
two reads survives, invalid bytes become U+FFFD.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["OutputCollector", "TextCollector", "clean", "elide", "strip_ansi"]

# CSI (ESC [ ... final), other two-char ESC sequences, OSC (ESC ] ... BEL/ST), DCS/PM/APC.
_ANSI_RE = re.compile(
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC ... BEL | ST
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS / SOS / PM / APC ... ST
    r"|\x1b\[[0-?]*[ -/]*[@-~]"  # CSI
    r"|\x1b[@-Z\\-_]"  # other 7-bit C1 escapes
    r"|\x1b[ -/]+[0-~]"  # nF escapes (charset selection etc.)
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI (after decoding)
)
# C0 controls except \t and \n (\r is handled separately), DEL, and C1 controls.
_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def strip_ansi(text: str) -> str:
    """Remove terminal escape sequences (colours, cursor movement, titles, bracketed paste)."""
    if "\x1b" not in text and "\x9b" not in text:
        return text
    return _ANSI_RE.sub("", text)


def _resolve_cr(line: str) -> str:
    # "50%\r100%" shows as "100%" on a terminal; keep the last non-empty segment.
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def clean(text: str) -> str:
    """ANSI-free, ``\\n``-only text without NULs or other control characters."""
    text = strip_ansi(text)
    if "\r" in text:
        text = text.replace("\r\n", "\n")
        if "\r" in text:
            text = "\n".join(_resolve_cr(line) if "\r" in line else line
                             for line in text.split("\n"))
    return _CTRL_RE.sub("", text)


def elide(text: str, max_chars: int, *, hint: str = "") -> str:
    """Cut ``text`` to ``max_chars`` (half head, half tail) with a note in the middle."""
    if len(text) <= max_chars:
        return text
    half = max(max_chars // 2, 1)
    cut = len(text) - 2 * half
    return _join(text[:half], text[-half:], f"{cut} characters", hint)


def _join(head: str, tail: str, what: str, hint: str) -> str:
    note = f"\n[... {what} omitted from the middle of the output{hint} ...]\n"
    return head.rstrip("\n") + note + tail.lstrip("\n")


class OutputCollector:
    """Bounded head + tail of a byte stream.

    The first ``head_bytes`` are decoded incrementally as they arrive; after that only the
    last ``tail_bytes`` are kept. :meth:`text` returns the cleaned text and the number of
    bytes dropped in between.
    """

    def __init__(self, head_bytes: int = 64 * 1024, tail_bytes: int = 64 * 1024) -> None:
        self._head_limit = head_bytes
        self._tail_limit = tail_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head: list[str] = []
        self._head_len = 0
        self._tail = bytearray()
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.total_bytes += len(data)
        room = self._head_limit - self._head_len
        if room > 0:
            take = data[:room]
            self._head.append(self._decoder.decode(take))
            self._head_len += len(take)
            data = data[room:]
            if not data:
                return
        self._tail += data
        if len(self._tail) > 2 * self._tail_limit:
            del self._tail[: len(self._tail) - self._tail_limit]

    @property
    def omitted_bytes(self) -> int:
        return max(0, self.total_bytes - self._head_len - min(len(self._tail), self._tail_limit))

    def text(self) -> tuple[str, str, int]:
        """``(head, tail, omitted_bytes)``, each part cleaned; ``tail`` is empty when nothing
        went past the head."""
        head = "".join(self._head)
        if not self._tail:
            head += self._decoder.decode(b"", final=True)
            return clean(head), "", 0
        tail = bytes(self._tail[-self._tail_limit :])
        omitted = self.omitted_bytes
        if omitted:
            # the tail starts mid-stream: skip UTF-8 continuation bytes at its start
            i = 0
            while i < min(3, len(tail)) and 0x80 <= tail[i] <= 0xBF:
                i += 1
            tail_text = tail[i:].decode("utf-8", errors="replace")
        else:
            # contiguous with the head: finish the head decoder's pending bytes
            tail_text = self._decoder.decode(tail, final=True)
        return clean(head), clean(tail_text), omitted

    def render(self, max_chars: int, *, hint: str = "") -> str:
        """Cleaned text, at most about ``max_chars``, with a note when anything was cut."""
        head, tail, omitted = self.text()
        if not omitted:
            return elide(head + tail, max_chars, hint=hint)
        half = max(max_chars // 2, 1)
        dropped = omitted
        if len(head) > half:
            dropped += len(head[half:].encode())
            head = head[:half]
        if len(tail) > half:
            dropped += len(tail[:-half].encode())
            tail = tail[-half:]
        return _join(head, tail, f"about {dropped} bytes", hint)


class TextCollector:
    """Bounded head + tail of a stream of text pieces (the kernel's outputs)."""

    def __init__(self, head_chars: int = 64 * 1024, tail_chars: int = 64 * 1024) -> None:
        self._head_limit = head_chars
        self._tail_limit = tail_chars
        self._head: list[str] = []
        self._head_len = 0
        self._tail: list[str] = []
        self._tail_len = 0
        self.omitted_chars = 0

    def feed(self, text: str) -> None:
        room = self._head_limit - self._head_len
        if room > 0:
            self._head.append(text[:room])
            self._head_len += min(room, len(text))
            text = text[room:]
        if not text:
            return
        self._tail.append(text)
        self._tail_len += len(text)
        if self._tail_len > 2 * self._tail_limit:
            joined = "".join(self._tail)
            self.omitted_chars += len(joined) - self._tail_limit
            self._tail = [joined[-self._tail_limit :]]
            self._tail_len = self._tail_limit

    def clear(self) -> None:
        self._head, self._tail = [], []
        self._head_len = self._tail_len = self.omitted_chars = 0

    def render(self, max_chars: int, *, hint: str = "") -> str:
        head = clean("".join(self._head))
        tail = clean("".join(self._tail))
        if not self.omitted_chars:
            return elide(head + tail, max_chars, hint=hint)
        half = max(max_chars // 2, 1)
        dropped = self.omitted_chars + max(0, len(head) - half) + max(0, len(tail) - half)
        return _join(head[:half], tail[-half:], f"{dropped} characters", hint)
