"""The docs' links hold: every relative Markdown link in README.md and docs/*.md names a file that exists (and
a heading in it, for a ``#anchor``), every ``docs/NAME.md`` a module under ``src/`` or ``dev/`` names exists, and
so does every test file (and test) a page names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``[text](target)``, not an image's; the target ends at whitespace or ``)``
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
#: ``docs/NAME.md`` as a module names it (also ``docs/NAME.md#anchor``)
DOC_NAME = re.compile(r"(?<![\w/.-])docs/[\w./-]+?\.md")


def _code_free(text: str) -> str:
    """The page without its fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_code_free(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_every_docs_page_a_module_names_exists():
    missing = []
    for tree in ("src", "dev"):
        for module in sorted((ROOT / tree).rglob("*.py")):
            for name in set(DOC_NAME.findall(module.read_text(encoding="utf-8"))):
                if not (ROOT / name).is_file():
                    missing.append(f"{module.relative_to(ROOT)}: {name}")
    assert missing == []


def test_anchors_follow_githubs_rule(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# The `--docs` option: a page's A/B\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"the---docs-option-a-pages-ab", "twice", "twice-1"}


#: a test file as a page names it: ``tests/...py`` or the instruments' ``dev/tests/...py``
TEST_FILE = r"(?<![\w/.-])(?:dev/)?tests/[\w/]+\.py"


def test_every_test_file_a_page_names_exists():
    missing = []
    for page in PAGES:
        for path in set(re.findall(TEST_FILE, page.read_text(encoding="utf-8"))):
            if not (ROOT / path).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def test_every_test_a_page_names_exists():
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path, name in set(re.findall(rf"({TEST_FILE})::(\w+)", text)):
            test_file = ROOT / path
            if not test_file.is_file() or not re.search(rf"def {name}\(", test_file.read_text(encoding="utf-8")):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{name}")
    assert missing == []
