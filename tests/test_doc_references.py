"""References from the code to the documentation resolve: a ``README "Title"`` in a docstring, comment or message
names a heading or a bold paragraph title of README.md or of a docs page (the README's sections moved to docs/), a
``docs/<page>.md "Title"`` names one on that page, every ``docs/<page>.md`` named exists, and no file of the
package points at a path outside the repository (a fresh clone has no ../shared)."""

from __future__ import annotations

import re
from pathlib import Path

from doctext import doc_pages

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kvtier", "connectors", "pool", "master", "bench")
# README "Title", README 'Title', README's "Title"; a title may be split over two string literals or lines
REFERENCE = re.compile(r"README(?:'s)?\s+[\"']([^\"']+?)[\"']")
# docs/page.md "Title", docs/page.md's 'Title' (an escaped \" inside a string literal too)
PAGE_REFERENCE = re.compile(r"docs/([\w-]+\.md)(?:'s)?,?\s+\\?([\"'])(.{1,200}?)\\?\2", re.S)
PAGE = re.compile(r"\bdocs/([\w-]+\.md)\b")


def _code() -> list[Path]:
    return [p for d in CODE for p in sorted((ROOT / d).rglob("*.py"))]


def _joined(path: Path) -> str:
    return re.sub(r"[\"']\s*\n\s*[\"']", "", path.read_text())  # join implicitly concatenated literals


def _titles(page: Path) -> list[str]:
    text = page.read_text()
    titles = re.findall(r"^#+\s+(.*)$", text, re.M) + re.findall(r"\*\*([^*]+)\*\*", text)
    return [" ".join(t.split()).lower() for t in titles]


def _norm(title: str) -> str:
    """A title as cited, its lines joined (a comment's continuation lines without their #), lower case."""
    return " ".join(re.sub(r"\n\s*#", " ", title).split()).lower()


def test_every_readme_reference_in_the_code_names_a_section_or_a_titled_paragraph():
    """The older form, README "Title" (the code cites docs/<page>.md "Title" now): still resolved, against README.md
    and every docs page, where the README's sections went."""
    titles = [t for page in doc_pages() for t in _titles(page)]
    broken = []
    for path in _code():
        for m in REFERENCE.finditer(_joined(path)):
            if not any(_norm(m.group(1)) in t for t in titles):
                broken.append(f"{path.relative_to(ROOT)}: README {m.group(1)!r}")
    assert not broken, "references to documentation sections that do not exist:\n" + "\n".join(broken)


def test_every_docs_page_reference_in_the_code_names_a_title_on_that_page():
    refs, broken = 0, []
    for path in _code():
        for m in PAGE_REFERENCE.finditer(_joined(path)):
            refs += 1
            page = ROOT / "docs" / m.group(1)
            if not page.is_file() or not any(_norm(m.group(3)) in t for t in _titles(page)):
                broken.append(f"{path.relative_to(ROOT)}: docs/{m.group(1)} {m.group(3)!r}")
    assert refs >= 10, "the pattern found almost no docs/<page>.md \"Title\" references: it no longer matches the code"
    assert not broken, "references to titles their docs page lacks:\n" + "\n".join(broken)


def test_every_docs_page_the_repository_names_exists_and_reliability_md_moved():
    files = _code() + sorted((ROOT / "tests").rglob("*.py")) + [ROOT / "tests" / "run.sh", ROOT / ".ci" / "run",
                                                                ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    missing, stale = [], []
    for path in files:
        if not path.is_file() or path == Path(__file__):
            continue
        text = path.read_text()
        missing += [f"{path.relative_to(ROOT)}: docs/{name}" for name in PAGE.findall(text)
                    if not (ROOT / "docs" / name).is_file()]
        if "RELIABILITY.md" in text:
            stale.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs pages named but absent: {missing}"
    assert not stale, f"RELIABILITY.md is docs/reliability.md now; still named in {stale}"


def test_no_file_of_the_package_points_outside_the_repository():
    pattern = re.compile(r"(/work/shared|\.\./shared)/")
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in _code()
               for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not outside, f"paths outside the repository (a fresh clone has none): {outside}"
