"""Text a user hands over (captions, prompts, file names): read as UTF-8, and where it is not, said where and why;
shown in a Markdown report as the text it is."""

from __future__ import annotations

import codecs
import re
import sys
from collections.abc import Iterable


class NotUtf8(ValueError):
    """The bytes are not UTF-8; the message says at which line and byte, and the usual reason. `encoding`: what they
    probably are, for the caller's `iconv -f` fix (cp1252 for Latin-1's bytes, utf-32 where its mark says so); None
    where no conversion would make the text (a UTF-16 file cut short)."""

    def __init__(self, message: str, encoding: str | None = None) -> None:
        super().__init__(message)
        self.encoding = encoding


def decode_utf8(raw: bytes) -> str:
    """`raw` as UTF-8 text, a byte-order mark (Windows editors write one) dropped, or as UTF-16 where it begins with
    UTF-16's mark (Windows PowerShell 5.1's `>` and Notepad's "Unicode" write it; curve CSVs are read so too); NotUtf8
    ("line N is not UTF-8 text (byte 0xNN; probably saved as Latin-1 or Windows-1252)") where it is neither, for the
    caller to add its fix. A UTF-16 file was called Latin-1 by its mark's first byte, 0xff, and converted from cp1252
    as told, it became a file of NULs between the letters."""
    if raw.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):  # UTF-32 LE's mark begins with UTF-16 LE's
        raise NotUtf8("is UTF-32 text (it begins with UTF-32's byte-order mark)", "utf-32")
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError as e:
            raise NotUtf8(f"begins with UTF-16's byte-order mark but is not UTF-16 text (byte {e.start}: "
                          f"{e.reason})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise NotUtf8(f"line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}; probably saved as Latin-1 or "
                      "Windows-1252)", "cp1252") from None


# What CommonMark (and the KFP UI's markdown-to-jsx) can read as markup in running text: `<` opens raw HTML, which a
# renderer passes on (an image named `<img src=x onerror=...>.png` became an <img> that ran its script), `&` an
# entity, the rest emphasis, links, code and table cells. Backslash escapes any of them (CommonMark 0.31, 2.4).
_MARKDOWN_MARKUP = frozenset("\\`*_[]<>&|~!")


def percent(fraction: float) -> str:
    """A fraction a user set (a tolerance, a margin), as a percent with the digits it was given: 0.005 as 0.5%, 0.125
    as 12.5%, 0.2 as 20%. A whole percent (`:.0%`) said 0% for 0.005 and 12% for 0.125."""
    return f"{fraction * 100:.3g}%"


def printable(text: object) -> str:
    """`text` with each character that is not printable (a control or invisible format character, Unicode Cc and Cf:
    a newline or an ESC in a file name, a right-to-left override; any other but the space, too) written as its escape,
    `\\n`, `\\x1b`, `\\u202e`: one line, and the name as it really is, in a report or on a terminal, where an ESC
    sequence could clear the screen or hide what follows."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def is_header_token(text: str) -> bool:
    """Whether `text` can go in an HTTP header as a bearer token: no space, line break or other unprintable character
    (a secret copied with its newline has one, and the HTTP libraries fail on it in words of their own)."""
    return not any(c.isspace() or not c.isprintable() for c in text)


def warn(lines: Iterable[str], out=None) -> None:
    """Each line on stderr as `rangefinder: warning: ...`, printable (a local run's progress shows lines of this form
    too): every command and step warns through this, so a file name's ESC sequence never reaches a terminal raw."""
    for line in lines:
        print(f"rangefinder: warning: {printable(line)}", file=out or sys.stderr, flush=True)


def markdown_text(text: str) -> str:
    """User text (a file or folder name, inside a sentence) as Markdown that renders as that text, never as markup."""
    return "".join("\\" + c if c in _MARKDOWN_MARKUP else c for c in printable(text))


def markdown_cell(text: object) -> str:
    """Our own text (a description, a report's value or note) as one cell of a Markdown table: on one line, its `|`
    escaped, which would otherwise end the cell (None is an empty cell)."""
    return " ".join(("" if text is None else str(text)).split()).replace("|", "\\|")


def markdown_code(text: str) -> str:
    """User text as a Markdown code span, whose content is never markup: fenced by more backticks than any run of
    them inside it, and padded with a space where it starts or ends with one (CommonMark 0.31, 6.1)."""
    shown = printable(text)
    fence = "`" * (max((len(run) for run in re.findall("`+", shown)), default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"
