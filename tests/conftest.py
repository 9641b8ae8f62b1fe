"""Shared test helpers: deterministic block contents, so any reader can check any writer's bytes."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

# Triton fixes its mode when it is first imported, and any test module may import it first (vLLM does, and the
# hybrid bench's tests import vLLM at collection): on a machine without a GPU the kernel tests run Triton in its
# interpreter, so the interpreter is asked for here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def block_for(key: bytes, nbytes: int) -> torch.Tensor:
    """Bytes that depend only on the key: two threads writing one key write the same block."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & 0x7FFF_FFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def blocks_for(keys: list[bytes], nbytes: int) -> torch.Tensor:
    return torch.stack([block_for(k, nbytes) for k in keys]) if keys else torch.empty(0, nbytes, dtype=torch.uint8)


@pytest.fixture
def make_keys():
    from kvtier.keys import Namespace

    ns = Namespace("test-model")
    return lambda n, start=0: ns.keys(range(start, start + n))


# The vLLM connector tests' fixtures (model, ipc_dir, engine), found by name; they import vLLM only when used.
pytest_plugins = ["vllm_fixtures"]


RUNTIME_DIR = pytest.StashKey[str]()  # this run's owner-token directory (pytest_configure)


def pytest_configure(config):
    """The suite's own owner-token directory (kvtier/auth/owner.py; 0700, as the daemons check): token files
    an earlier run's daemons left (killed ones keep theirs) must not make this run's clients speak PLAIN to a
    server on a reused port. Daemons started as subprocesses inherit it."""
    import os
    import tempfile

    from kvtier.envvars import ENV_RUNTIME_DIR

    config.stash[RUNTIME_DIR] = tempfile.mkdtemp(prefix="kvtier-tests-runtime-")  # mkdtemp: mode 0700
    os.environ[ENV_RUNTIME_DIR] = config.stash[RUNTIME_DIR]


def pytest_unconfigure(config):
    import os
    import shutil

    from kvtier.envvars import ENV_RUNTIME_DIR

    d = config.stash.get(RUNTIME_DIR, None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop(ENV_RUNTIME_DIR, None)
