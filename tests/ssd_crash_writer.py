"""The writer half of the SSD crash test: puts, removes and write-behind on a DiskTier until it is killed.

Runs in a child process (forked from a forkserver that has kvtier imported, so each of the many kills costs
milliseconds, not an interpreter start). Every acknowledged operation is appended to an ack log with one
unbuffered write, so the parent knows, after the SIGKILL, what the tier promised.
Block contents derive from the key alone (``block_bytes_for``), so any reader can check any block.
"""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np

BLOCK = 65536
UNIVERSE = 160  # distinct keys
CAPACITY = 64  # blocks: evictions happen all the time


def block_bytes_for(key: bytes, nbytes: int = BLOCK) -> bytes:
    return hashlib.shake_128(key).digest(nbytes)


def keys() -> list[bytes]:
    from kvtier.keys import Namespace

    return Namespace("crash").keys(range(UNIVERSE))


def open_tier(path: str):
    from kvtier.pins import PinTable
    from kvtier.tiers.ssd import DiskTier

    t = DiskTier(path, CAPACITY * BLOCK, BLOCK, segment_bytes=8 * BLOCK, staging_bytes=16 * BLOCK)
    t.attach(PinTable(), None)
    return t


def run(path: str, ack_path: str, seed: int) -> None:
    rng = random.Random(seed)
    ks = keys()
    t = open_tier(path)
    ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(ack, b"ready\n")
    while True:
        batch = rng.sample(range(UNIVERSE), rng.randint(1, 12))
        op = rng.random()
        if op < 0.1:
            # Logged before the remove: a kill in the middle of it may have dropped any of these already, so
            # from here on they are not promised (logging after it made a kill between the two a false "lost").
            os.write(ack, f"del {' '.join(map(str, batch))}\n".encode())
            t.remove([ks[i] for i in batch])
            continue
        before = t.contains([ks[i] for i in batch])
        data = np.frombuffer(b"".join(block_bytes_for(ks[i]) for i in batch), np.uint8).reshape(len(batch), BLOCK)
        if op < 0.3:
            fut = t.put_later([ks[i] for i in batch], data, wait=True)
            stored = set(fut.result()) if fut is not None else set()
            t.flush()
            held = [ks[i] in stored or t.contains([ks[i]])[0] for i in batch]
        else:
            held = t.put([ks[i] for i in batch], data)
        # Acknowledge the blocks this put stored: the newest in the tier, so the next (unfinished) put cannot
        # have evicted them. Keys held before keep their old place in the eviction order.
        new = [i for i, h, b in zip(batch, held, before) if h and not b]
        os.write(ack, f"put {' '.join(map(str, new))}\n".encode())
