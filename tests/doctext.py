"""The documentation as the tests read it: README.md (the short front page) and the pages of docs/ (mkdocs.yml's
site). A test that checks a command, a table or a title of the documentation reads the page it lives on, or all of
them where it may be on either (a command shown in README.md and again on its docs page)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def doc_pages() -> list[Path]:
    """README.md, then every docs/*.md page in name order."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def page_text(name: str) -> str:
    """One page: "README.md" or a docs page by file name ("configuration.md")."""
    return (ROOT / name if name == "README.md" else DOCS / name).read_text()


def docs_text() -> str:
    """README.md and every docs page, one after another."""
    return "\n\n".join(p.read_text() for p in doc_pages())


def bash_blocks() -> list[str]:
    """The ```bash blocks of README.md and the docs pages, each once (a block may be on two pages)."""
    blocks: list[str] = []
    for page in doc_pages():
        blocks += [b for b in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S) if b not in blocks]
    return blocks


def commands(head: str, paragraphs: bool) -> list[list[str]]:
    """Every command of the bash blocks that starts with ``head``, split as a shell would (continuation lines
    joined), each once: a paragraph each where ``paragraphs`` (a command over several lines), else a line each."""
    found: list[list[str]] = []
    for block in bash_blocks():
        pieces = re.split(r"\n\s*\n", block) if paragraphs else block.split("\n")
        for piece in pieces:
            if piece.strip().startswith(head):
                words = shlex.split(piece.replace("\\\n", ""), comments=True)
                if words not in found:
                    found.append(words)
    return found
