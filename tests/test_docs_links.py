"""The documents' own links lead somewhere: a relative link names a file of the repository, and a `#fragment` names a
heading of the document it points into, spelled as GitHub spells a heading's anchor. `bench/RESULTS.md`'s contents
list links headings of over a hundred characters, which a reworded heading would silently break."""
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOCUMENTS = ("README.md", "bench/RESULTS.md", "tests/SUITE.md",
             *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> Iterator[str]:
    """GitHub's anchor of each heading outside code blocks: lower case, punctuation but `-` and `_` dropped, spaces
    as `-`, a repeated anchor numbered `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            yield slug if n == 0 else f"{slug}-{n}"


def test_every_relative_link_and_anchor_in_the_documents_resolves():
    broken, checked = [], 0
    for doc in DOCUMENTS:
        path = ROOT / doc
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:, models:/ ...: not a file here
                continue
            file, _, fragment = target.partition("#")
            into = (path.parent / file).resolve() if file else path
            checked += 1
            if not into.exists():
                broken.append(f"{doc}: {target}: no file {into}")
            elif fragment and (into.suffix != ".md" or fragment not in set(anchors(into.read_text()))):
                broken.append(f"{doc}: {target}: no heading with that anchor in {into.relative_to(ROOT)}")
    assert checked > 15 and broken == [], "\n".join(broken)


def test_anchors_are_spelled_as_github_spells_them():
    text = "# A: b (`python -m x.y`)\n```\n# not a heading\n```\n## A: b (`python -m x.y`)\n### (a)'s LR\n"
    assert list(anchors(text)) == ["a-b-python--m-xy", "a-b-python--m-xy-1", "as-lr"]
