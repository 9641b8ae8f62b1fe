"""References from the code to the documentation resolve: a ``README "Title"`` in a docstring, comment or message
names a heading or a bold paragraph title of README.md, and no file of the package points at a path outside the
repository (a fresh clone has no ../shared)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kvtier", "connectors", "pool", "master", "bench")
# README "Title", README 'Title', README's "Title"; a title may be split over two string literals or lines
REFERENCE = re.compile(r"README(?:'s)?\s+[\"']([^\"']+?)[\"']")


def _code() -> list[Path]:
    return [p for d in CODE for p in sorted((ROOT / d).rglob("*.py"))]


def _titles() -> list[str]:
    text = (ROOT / "README.md").read_text()
    titles = re.findall(r"^#+\s+(.*)$", text, re.M) + re.findall(r"\*\*([^*]+)\*\*", text)
    return [" ".join(t.split()).lower() for t in titles]


def test_every_readme_reference_in_the_code_names_a_section_or_a_titled_paragraph():
    titles = _titles()
    refs, broken = 0, []
    for path in _code():
        text = re.sub(r"[\"']\s*\n\s*[\"']", "", path.read_text())  # join implicitly concatenated literals
        for m in REFERENCE.finditer(text):
            refs += 1
            name = " ".join(m.group(1).split()).lower()
            if not any(name in t for t in titles):
                broken.append(f"{path.relative_to(ROOT)}: README {m.group(1)!r}")
    assert refs >= 10, "the pattern found almost no references: it no longer matches how the code cites the README"
    assert not broken, "references to README sections that do not exist:\n" + "\n".join(broken)


def test_no_file_of_the_package_points_outside_the_repository():
    pattern = re.compile(r"(/work/shared|\.\./shared)/")
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in _code()
               for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not outside, f"paths outside the repository (a fresh clone has none): {outside}"
