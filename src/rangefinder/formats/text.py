"""Text files a user hands over (captions, prompts): read as UTF-8, and where they are not, said where and why."""

from __future__ import annotations


class NotUtf8(ValueError):
    """The bytes are not UTF-8; the message says at which line and byte, and the usual reason."""


def decode_utf8(raw: bytes) -> str:
    """`raw` as UTF-8 text, a byte-order mark (Windows editors write one) dropped; NotUtf8 ("line N is not UTF-8
    text (byte 0xNN; probably saved as Latin-1 or Windows-1252)") where it is not, for the caller to add its fix."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise NotUtf8(f"line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}; probably saved as Latin-1 or "
                      "Windows-1252)") from None
