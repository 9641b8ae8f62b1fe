"""What only the owner should see: the master's Prometheus port binds loopback unless widened, and the master's
data dir and the SSD tier's index and segments are private to their owner even under umask 000 (real daemon
and engine processes; modes read from the file system, the bound address from /proc/PID/net/tcp)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from kvtier.client import MasterClient, api
from masterproc import MasterProcess

UMASK_000 = ("sh", "-c", 'umask 000; exec "$0" "$@"')


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def listening(pid: int, port: int) -> list[str]:
    """The local addresses (hex, as /proc writes them) of TCP sockets of ``pid`` listening on ``port``."""
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_the_masters_metrics_port_binds_loopback_unless_widened(tmp_path):
    with MasterProcess(tmp_path, metrics_host=None) as master:
        assert listening(master.pid, master.metrics_port) == ["0100007F"]  # 127.0.0.1
    with MasterProcess(tmp_path, metrics_host="0.0.0.0") as master:
        assert listening(master.pid, master.metrics_port) == ["00000000"]


def test_the_masters_data_dir_is_private_even_under_umask_000(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)  # an existing dir, readable by others: tightened
    data.chmod(0o755)
    with MasterProcess(tmp_path, data_dir=data, prefix=UMASK_000, lease_s=30.0) as master:
        with MasterClient(master.endpoint) as m:
            m.call(api.register("n", "inc", 0, [("dram", 1 << 30)]))
            m.pin(session="s", ttl_s=60)
        assert master.terminate() == 0
    lm = data / "master.lmdb"
    assert mode(data) == 0o700 and mode(lm) == 0o700
    files = sorted(p.name for p in lm.iterdir())
    assert files == ["data.mdb", "lock.mdb"] and all(mode(lm / f) == 0o600 for f in files)


ENGINE = r"""
import sys, torch
from kvtier import TieredStore
from kvtier.keys import Namespace
keys = Namespace("m").keys(range(8))
s = TieredStore.from_config({"dram_capacity": 8 * 4096, "ssd_path": sys.argv[1], "ssd_capacity": "1MiB",
                             "ssd_offload": "write_through", "ssd_segment_bytes": "64KiB"}, 4096)
s.put(keys, torch.full((8, 4096), 7, dtype=torch.uint8))
s.close()
"""


def test_the_ssd_tiers_index_and_segments_are_private_even_under_umask_000(tmp_path):
    ssd = tmp_path / "ssd"
    subprocess.run([*UMASK_000, sys.executable, "-c", ENGINE, str(ssd)], check=True, timeout=120)
    dirs = [ssd] + [p for p in ssd.rglob("*") if p.is_dir()]
    files = [p for p in ssd.rglob("*") if p.is_file()]
    assert len(files) >= 3  # segment files, the index's data and lock files, the tier's lock
    assert {str(p.relative_to(ssd)): oct(mode(p)) for p in dirs if mode(p) != 0o700} == {}
    assert {str(p.relative_to(ssd)): oct(mode(p)) for p in files if mode(p) != 0o600} == {}
