"""Every relative link in the README, docs/ and results/ (the lab's studies) reaches a file, and every
``#anchor`` a heading of the page it names (GitHub's anchors), so moving a section between pages
cannot leave a reader at a dead link."""

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "results").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@cache
def anchors(page: Path) -> frozenset[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    repeats numbered -1, -2, ...; headings inside code fences do not count."""
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#+\s+(.*)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def test_the_anchor_rule_matches_githubs():
    page = ROOT / "results" / "notebook.md"
    assert "where-issue-26s-goal-stands" in anchors(page)  # "Where issue 26's goal stands"
    assert "snip-against-the-oracle-4-layers-mxfp4-75" in anchors(page)  # "...: 4 layers, MXFP4, 75%"


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
