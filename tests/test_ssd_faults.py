"""Real disk faults under the SSD tier: a full filesystem, a device that runs out of space, a device that fails
reads. Each stops admission once (logged, reason in stats) while the store keeps serving; root only (mounts).

Faults are real kernel errors, not mocks: ENOSPC from a size-limited tmpfs; ENOSPC then EIO from ext4 on a
loop device whose backing file sits on a full tmpfs; EIO on reads from a loop device shrunk under its
filesystem. (There is no device-mapper "error" target or fault injection in this kernel to do it otherwise.)
"""

import logging
import subprocess

import torch

from bytecheck import assert_no_wrong_bytes
from conftest import blocks_for
from kvtier import Namespace, TieredStore
from ssd_helpers import loop_ext4, mounted, open_tier

BB = 65536
KEYS = Namespace("faults").keys(range(160))


def _stopped_records(caplog):
    return [r for r in caplog.records if "stopped admitting" in r.getMessage()]


def test_full_filesystem_stops_admission_and_dram_keeps_serving(tmp_path, caplog):
    with mounted("tmpfs", tmp_path / "small", "size=512k") as where:  # room for ~7 blocks; configured for 32
        store = TieredStore.from_config({"dram_capacity": 4 * BB, "ssd_path": str(where), "ssd_capacity": 32 * BB,
                                         "ssd_segment_bytes": 4 * BB, "ssd_offload": "write_through"}, BB)
        data = blocks_for(KEYS[:24], BB)
        with caplog.at_level(logging.ERROR):
            for i in range(0, 24, 4):
                assert store.put(KEYS[i:i + 4], data[i:i + 4]).stored == 4  # DRAM never refuses for SSD trouble
                store.flush(10)
        ssd = store.stats()["tiers"]["ssd"]
        assert not ssd["extra"]["admitting"] and "ENOSPC" in ssd["extra"]["stopped_reason"]
        assert ssd["extra"]["write_errors"] >= 1
        assert len(_stopped_records(caplog)) == 1  # logged once, however many writes failed after
        assert 0 < ssd["blocks"] < 24
        out = torch.zeros(24, BB, dtype=torch.uint8)
        hit = store.get(KEYS[:24], out)
        assert hit[20:] == [True] * 4  # DRAM
        assert sum(hit) == 4 + ssd["blocks"] - sum(1 for k in KEYS[20:24] if store.tiers[1].contains([k])[0])
        assert_no_wrong_bytes(hit, out, data)
        assert store.tiers[1].put_later(KEYS[30:31], data[:1], wait=False) is None  # refuses, does not raise
        store.close()


def test_device_out_of_space_under_the_filesystem(tmp_path, caplog):
    """ext4 believes it has 64 MiB; the loop device's backing file can only grow to 6 MiB: the device fails
    the writes (ENOSPC) and the filesystem then fails fsync (EIO)."""
    with mounted("tmpfs", tmp_path / "backing", "size=6m") as backing, \
            loop_ext4(backing / "disk.img", "64M", tmp_path / "fs") as (where, _dev):
        t = open_tier(where, 160, BB, segment_bytes=16 * BB)  # 10 MiB of blocks
        data = blocks_for(KEYS, BB)
        with caplog.at_level(logging.ERROR):
            held = []
            for i in range(0, 160, 16):
                held += t.put(KEYS[i:i + 16], data[i:i + 16])
        extra = t.stats().extra
        assert not extra["admitting"] and any(e in extra["stopped_reason"] for e in ("ENOSPC", "EIO", "EROFS"))
        assert len(_stopped_records(caplog)) == 1
        assert not all(held)
        out = torch.zeros(160, BB, dtype=torch.uint8)
        hit = t.get(KEYS, out)  # what it still serves is bit-exact (or a counted miss)
        assert_no_wrong_bytes(hit, out, data)
        t.close()


def test_read_errors_are_misses_and_stop_admission(tmp_path, caplog):
    """Blocks past the end of a shrunk loop device fail with EIO: misses, counted, admission stopped."""
    with loop_ext4(tmp_path / "disk.img", "64M", tmp_path / "fs") as (where, dev):
        t = open_tier(where, 48, BB, segment_bytes=48 * BB)  # one 3 MiB segment file
        data = blocks_for(KEYS[:48], BB)
        assert all(t.put(KEYS[:48], data))
        subprocess.run(["truncate", "-s", "8M", str(tmp_path / "disk.img")], check=True)
        subprocess.run(["losetup", "-c", dev], check=True)  # the device now ends at 8 MiB
        out = torch.zeros(48, BB, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING):
            hit = t.get(KEYS[:48], out)
        extra = t.stats().extra
        assert not all(hit) and extra["read_errors"] == hit.count(False)
        assert_no_wrong_bytes(hit, out, data)
        assert not extra["admitting"] and "EIO" in extra["stopped_reason"]
        assert t.contains([k for k, h in zip(KEYS, hit) if not h]) == [False] * hit.count(False)
        t.close()
