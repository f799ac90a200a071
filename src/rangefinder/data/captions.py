"""Caption text as tags: the comma-separated form of booru-style captions ("1girl, red hair, smiling").

Tag shuffle puts a caption's tags in a new order each time its image is drawn, so the model does not tie a concept
to a tag's position; the first `keep` tags (a trigger word, the subject) stay where they are. The order comes from
the caller's random draw (`order`), so this module holds no randomness of its own and stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

TAG_SEPARATOR = ","


def split_tags(text: str) -> list[str]:
    """The caption's tags, stripped, empty ones dropped."""
    return [t.strip() for t in text.split(TAG_SEPARATOR) if t.strip()]


def movable_tags(text: str, keep: int) -> int:
    """How many of the caption's tags tag shuffle may move (those after the first `keep`)."""
    return max(0, len(split_tags(text)) - keep)


def shuffled_caption(text: str, keep: int, order: Sequence[int]) -> str:
    """The caption with its first `keep` tags in place and the rest in `order` (a permutation of
    range(movable_tags(text, keep))), joined with ", "."""
    tags = split_tags(text)
    head, tail = tags[:keep], tags[keep:]
    if sorted(order) != list(range(len(tail))):
        raise ValueError(f"order {list(order)} is not a permutation of the {len(tail)} movable tags")
    return ", ".join(head + [tail[i] for i in order])


def long_captions(
    items: Sequence[tuple[str, str]], count_tokens: Callable[[str], int], limit: int
) -> list[dict[str, object]]:
    """The (file_name, caption) pairs whose caption has more than `limit` tokens: what the text encoder cuts off.

    Returned as `{"file_name", "tokens"}`, in the items' order.
    """
    out: list[dict[str, object]] = []
    for name, text in items:
        n = count_tokens(text)
        if n > limit:
            out.append({"file_name": name, "tokens": n})
    return out


def long_caption_report(found: Optional[list[dict[str, object]]], limit: Optional[int]) -> Optional[dict]:
    """The split summary's `long_captions` entry (None: no tokenizer was given, so nothing was counted)."""
    if found is None or limit is None:
        return None
    return {"limit": limit, "count": len(found), "files": found}
