"""Files only their owner reads: the master's data dir, the SSD tier's segments and index.

What they hold says what users' prompts are (keys, hints, KV bytes), so kvtier makes its own directories 0700
and its files 0600 whatever the process umask, and tightens those it finds readable by others (a directory
made by an older kvtier, or under umask 000), saying so in the log once per path.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with ``path`` itself 0700, or make an existing one so."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _restrict(path, 0o700)


def private_files(path: Path) -> None:
    """Every file directly in ``path`` 0600 (e.g. lmdb's data and lock files)."""
    for f in path.iterdir():
        if f.is_file():
            _restrict(f, 0o600)


def _restrict(path: Path, mode: int) -> None:
    current = stat.S_IMODE(path.stat().st_mode)
    if current & 0o077:
        path.chmod(mode)
        log.info("%s was readable by others (mode %04o): made it %04o", path, current, mode)
