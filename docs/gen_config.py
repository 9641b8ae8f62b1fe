"""mkdocs hook (mkdocs.yml ``hooks:``): the pages written from the code and the README instead of twice.

* docs/configuration.md: its ``<!-- kvtier:config-table -->`` becomes the table of every config key (key,
  default, meaning) rendered from the declarations in kvtier/settings/ (``key_field(default, "help")`` and its
  kinds, in ``kvtier.config.Config``'s order), so a key's default and help live only in the code; a reference
  ``docs/<page>.md 'Title'`` in a help text becomes a link to that page (and to the heading, where it is one).
* docs/index.md: its ``<!-- kvtier:readme -->`` becomes README.md, its ``docs/<page>.md`` links made relative.

tests/test_config.py renders the same table with ``config_table()`` and checks it against the keys.
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG_PLACEHOLDER = "<!-- kvtier:config-table -->"
README_PLACEHOLDER = "<!-- kvtier:readme -->"
# docs/<page>.md 'Title' (or "Title") in a help text
DOC_REFERENCE = re.compile(r"""docs/([\w-]+\.md) (['"])(.+?)\2""")


def slugify(title: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: markup dropped, lower case, words joined by -."""
    text = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def headings(page: str) -> list[str]:
    """The headings of docs/<page> (outside code blocks), as written."""
    text = re.sub(r"^```.*?^```", "", (DOCS / page).read_text(), flags=re.S | re.M)
    return re.findall(r"^#+\s+(.*?)\s*$", text, re.M)


def _link(m: re.Match[str]) -> str:
    page, title = m.group(1), m.group(3)
    if not (DOCS / page).is_file():
        raise ValueError(f"a config key's help names docs/{page}, which does not exist")
    for heading in headings(page):
        if slugify(heading) == slugify(title):
            return f"[{title}]({page}#{slugify(heading)})"
    return f"\"{title}\" in [{page.removesuffix('.md')}]({page})"  # a bold paragraph title: the page


def default_text(f: Any) -> str:
    """A key's default as a user writes it: sizes as declared ("4GiB"), booleans lower case, "" for empty."""
    if "default_text" in f.metadata:
        return str(f.metadata["default_text"])
    value = f.default
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return '""' if value == "" else str(value)


def config_table() -> str:
    """The Markdown table of every config key, from kvtier/settings/ (through kvtier.config.Config)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's kvtier, installed or not
    from kvtier.config import Config

    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(Config):
        meaning = " ".join(f.metadata.get("help", "").split())
        meaning = meaning.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").replace("|", "\\|")
        meaning = DOC_REFERENCE.sub(_link, meaning)  # help is plain text: escaped first, then the links
        rows.append(f"| `{f.name}` | {default_text(f)} | {meaning} |")
    return "\n".join(rows)


def readme_for_docs() -> str:
    """README.md as the site's home page: its links to docs/<page>.md relative to the docs folder."""
    text = (ROOT / "README.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """mkdocs event: fill the placeholders of configuration.md and index.md (each must have its own, once)."""
    from mkdocs.exceptions import PluginError

    wanted = {"configuration.md": (CONFIG_PLACEHOLDER, config_table), "index.md": (README_PLACEHOLDER, readme_for_docs)}
    for name, (placeholder, render) in wanted.items():
        here = page.file.src_uri == name
        if here and markdown.count(placeholder) != 1:
            raise PluginError(f"docs/{name} must hold {placeholder} once (docs/gen_config.py fills it)")
        if not here and placeholder in markdown:
            raise PluginError(f"docs/{page.file.src_uri}: {placeholder} belongs to docs/{name} only")
        if here:
            try:
                markdown = markdown.replace(placeholder, render())
            except ValueError as e:
                raise PluginError(str(e)) from None
    return markdown
