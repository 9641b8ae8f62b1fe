"""The documentation's shape (issue 28 item 5): a short README.md, the manual in docs/ as an mkdocs site whose nav
lists every page, and `mkdocs build --strict` passing (a broken link or anchor, a page missing from nav, or a
placeholder docs/gen_config.py cannot fill fails it; tests/run.sh runs the same build before pytest)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 12_500


def _nav_pages() -> list[str]:
    import yaml  # PyYAML: a dependency of mkdocs (the test extra)

    def walk(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [p for v in entry.values() for p in walk(v)]
        if isinstance(entry, list):
            return [p for v in entry for p in walk(v)]
        return []

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return walk(config["nav"])


def test_the_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} B (at most {README_MAX_BYTES}): move text to docs/"


def test_the_readme_keeps_the_two_quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, re.S)
    assert blocks[0].strip().endswith("pip install -e . && kvtier demo")
    assert blocks[1].strip() == "bash tests/run.sh"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    pytest.importorskip("yaml")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    nav = _nav_pages()
    assert sorted(nav) == pages, f"docs pages {pages} against mkdocs.yml's nav {nav}"
    assert len(nav) == len(set(nav)), "a page listed twice in nav"


def test_every_docs_page_the_readme_links_exists():
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[\w-]+)?\)", readme))
    assert linked, "the README links no docs page"
    missing = sorted(name for name in linked if not (ROOT / "docs" / name).is_file())
    assert not missing, f"the README links docs pages that do not exist: {missing}"


def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra (pip install -e '.[test]')")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    page = (tmp_path / "site" / "configuration.html").read_text()
    assert "<code>dram_capacity</code>" in page and "kvtier:config-table" not in page  # the hook filled the table
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quick start" in home and 'href="vllm.html"' in home  # README.md, its docs/ links made relative
