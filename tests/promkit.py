"""Debian's Prometheus tooling for the metrics tests: ``promtool check metrics`` on what a daemon serves, and a
real ``prometheus`` server scraping daemons (its own config, data dir and free port; killed at the end)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (tests/run.sh installs Debian's prometheus package with apt-get)")
    return path


def scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def promtool_check(text: str) -> subprocess.CompletedProcess:
    """``promtool check metrics`` on an exposition: rc 0 and no output when it is valid and lint-clean."""
    return subprocess.run([need("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)


class Prometheus:
    """A prometheus server scraping ``targets`` ({job: ["host:port", ...]}) every ``interval_s``."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]], interval_s: float = 0.5) -> None:
        self.tmp = Path(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        jobs = "\n".join(f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(t)}"
                         for job, t in targets.items())
        interval = f"{int(interval_s * 1000)}ms"
        (self.tmp / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\nscrape_configs:\n{jobs}\n")
        self.log = open(self.tmp / "prometheus.log", "a")
        self.proc = subprocess.Popen(
            [need("prometheus"), f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Results of ``expr`` once it has any (the server up and the targets scraped)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = (self.tmp / "prometheus.log").read_text()[-3000:]
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {log}")
            try:
                result = self.query(expr)
                if result:
                    return result
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus: no result for {expr!r} within {timeout} s")
            time.sleep(0.25)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
