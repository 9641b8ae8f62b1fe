"""Helpers for the SSD tier tests: a tier on a real-disk temp dir, and filesystems mounted for fault tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.pins import PinTable
from kvtier.tiers.ssd import DiskTier


def open_tier(path: Path, blocks: int, block_bytes: int, **kw) -> DiskTier:
    pins = kw.pop("pins", None)
    pins = PinTable() if pins is None else pins  # (an empty PinTable is falsy)
    on_evict = kw.pop("on_evict", None)
    kw.setdefault("segment_bytes", 4 * block_bytes)
    t = DiskTier(path, blocks * block_bytes, block_bytes, **kw)
    t.attach(pins, on_evict)
    return t


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (mount)")


@contextlib.contextmanager
def mounted(fstype: str, where: Path, options: str = "") -> Iterator[Path]:
    """Mount a fresh ``fstype`` (tmpfs, ramfs) at ``where`` for the duration (root only)."""
    need_root(f"mounting {fstype}")
    where.mkdir(parents=True, exist_ok=True)
    args = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount {fstype}: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def loop_ext4(image: Path, size: str, where: Path) -> Iterator[tuple[Path, str]]:
    """An ext4 filesystem on a loop device backed by ``image`` (a sparse file), mounted at ``where``.

    Yields (mount point, loop device). Real block-device errors come from the backing file: put it on a small
    tmpfs and the device runs out of space under the filesystem (ENOSPC, then EIO); shrink it and reads past
    the new end fail with EIO.
    """
    need_root("a loop device")
    for tool in ("losetup", "mkfs.ext4"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-E", "nodiscard", str(image)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    r = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no loop device: {r.stderr.strip()}")
    dev = r.stdout.strip()
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", dev, str(where)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount {dev}: {r.stderr.strip()}")
        try:
            yield where, dev
        finally:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)
