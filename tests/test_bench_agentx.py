"""``kvtier bench agentx`` without an engine: prompts from trace hashes (equal hashes give equal tokens, salts keep
replays apart, scaling fits the context or skips with a count), and the closed loop against a real HTTP server
on loopback that serves, then stalls or dies: the run reports what completed, says so, and ends within its
bounds. (The run against a real vLLM server is tests/engine/test_bench_agentx.py, slow.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.bench.agentx.client import Endpoint
from kvtier.bench.agentx.report import modeled, summarize
from kvtier.bench.agentx.loop import LoopConfig, run_loop
from kvtier.bench.agentx.workload import (SAMPLE_TRACES, PromptBuilder, Scaled, Scaling, TraceOrder,
                                          load_traces)
from kvtier.tools.replay.traces import inline, parse_agentic


def trace(requests: list[list[int]], name: str = "t", think: float = 0.0) -> Scaled:
    doc = {"id": name, "block_size": 64, "requests": [
        {"t": float(i), "in": 64 * len(ids) + 10, "out": 200, "hash_ids": ids, "think_time": think}
        for i, ids in enumerate(requests)]}
    return Scaled(parse_agentic(doc), 1, 32)


def test_equal_hashes_give_equal_tokens_and_salts_keep_replays_apart():
    s = trace([[1, 2, 3], [1, 2, 4, 5]])
    b = PromptBuilder(Scaling())
    r0, r1 = list(inline(s.trace.steps))
    a, c = b.prompt(s, r0, salt=7, serial=0), b.prompt(s, r1, salt=7, serial=1)
    assert a.tokens[:64] == c.tokens[:64]  # blocks 1, 2 shared
    assert a.tokens[64:96] != c.tokens[64:96]  # block 3 vs 4
    assert a.keys[:2] == c.keys[:2] and a.keys[2] != c.keys[2]
    other = b.prompt(s, r0, salt=8, serial=0)
    assert other.tokens[:32] != a.tokens[:32] and not set(other.keys) & set(a.keys)
    assert all(3 <= t < 1000 for t in a.tokens + c.tokens)
    assert b.prompt(s, r0, salt=7, serial=0, warmup=True).max_tokens == 1


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(1, 8))
def test_merged_prompts_share_exactly_the_whole_groups_they_share(lengths, merge):
    """With k trace blocks per engine block, two requests of one chain share floor(common / k) engine blocks."""
    chain = list(range(1, max(lengths) + 1))
    s = trace([chain[:n] for n in lengths])
    s.merge = merge
    b = PromptBuilder(Scaling(max_model_len=4096))
    reqs = list(inline(s.trace.steps))
    prompts = [b.prompt(s, r, 1, i) for i, r in enumerate(reqs)]
    for r, p in zip(reqs, prompts):
        assert len(p.keys) == len(r.blocks) // merge
        assert len(p.tokens) == len(p.keys) * 32 + min(31, max(1, round(r.input_tokens * s.token_scale)
                                                               - len(p.keys) * 32))
    for i in range(len(prompts)):
        for j in range(len(prompts)):
            common = min(lengths[i], lengths[j]) // merge
            assert prompts[i].keys[:common] == prompts[j].keys[:common]
            assert prompts[i].tokens[:common * 32] == prompts[j].tokens[:common * 32]


def test_the_sample_is_fitted_or_skipped_with_a_count():
    scaling = Scaling(block_tokens=32, max_model_len=2048, max_output=32, max_merge=40)
    fitted = load_traces([SAMPLE_TRACES], scaling)
    assert fitted.skipped and all("max_merge is 40" in why for why in fitted.skipped.values())
    b = PromptBuilder(scaling)
    for s in fitted.scaled:
        assert s.merge <= 40
        for i, r in enumerate(sorted(inline(s.trace.steps), key=lambda r: -r.input_tokens)[:3]):
            p = b.prompt(s, r, 1, i)
            assert len(p.tokens) + p.max_tokens <= 2048
    with pytest.raises(ValueError, match="no trace fits"):
        load_traces([SAMPLE_TRACES], Scaling(max_model_len=2048, max_merge=1))


def test_model_counts_hbm_then_dram_continuation():
    from kvtier.bench.agentx.client import Completion
    from kvtier.bench.agentx.loop import LoopResult, Sent

    keys = [bytes([i]) * 16 for i in range(6)]
    loop = LoopResult()
    for t, ks in enumerate([keys[:4], keys[4:6], keys[:5]]):
        loop.sent.append(Sent(0, 1, "window", ks, len(ks) * 32 + 1, 1, float(t), result=Completion(float(t))))
    # HBM of 3 blocks: the third request finds block 0..? evicted by the second; DRAM of 8 holds all.
    none = modeled(loop, 3, 0, 32)
    kv = modeled(loop, 3, 8, 32)
    assert none["dram"] == 0 and kv["dram"] > 0
    assert kv["total"] > none["total"]


# ---- the closed loop against a real HTTP server that fails -------------------------------------------------

class _Server:
    """An OpenAI-style streaming server on loopback: answers ``ok`` requests, then stalls or drops."""

    def __init__(self, ok: int, then: str) -> None:
        self.served, self.ok, self.then = 0, ok, then
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # noqa: ANN002 - quiet
                pass

            def do_GET(self):  # noqa: N802
                body = b"vllm:prompt_tokens_total 0\n" if self.path == "/metrics" else b"ok"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.served += 1
                    n = outer.served
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if n > outer.ok:
                    if outer.then == "stall":
                        time.sleep(30)
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                for _ in range(req["max_tokens"]):
                    self._chunk({"choices": [{"text": " w5"}]})
                self._chunk({"choices": [], "usage": {"prompt_tokens": len(req["prompt"]),
                                                      "completion_tokens": req["max_tokens"]}})
                data = b"data: [DONE]\n\n"
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))

            def _chunk(self, msg):  # noqa: ANN001
                data = b"data: " + json.dumps(msg).encode() + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _run(server: _Server, alive, duration: float = 1.5, warmup: float = 5.0):  # noqa: ANN001
    scaling = Scaling(max_model_len=1024, max_output=4)
    s = trace([list(range(1, 3 + i)) for i in range(12)], think=0.0)
    from kvtier.bench.agentx.workload import TraceSet
    cfg = LoopConfig(lanes=2, duration_s=duration, grace_s=1.0, warmup_s=warmup, think_cap_s=0.05, stall_s=0.5)
    return run_loop(Endpoint(server.url, "m"), TraceOrder(TraceSet([s]), 0), PromptBuilder(scaling), cfg,
                    lambda: {}, alive)


def test_a_stalling_server_that_still_answers_health_is_bounded_by_the_window():
    server = _Server(ok=3, then="stall")
    try:
        t0 = time.monotonic()
        loop = _run(server, lambda: True, duration=1.0, warmup=1.0)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert took < 1.0 + 1.0 + 1.0 + 1.0  # warm-up bound + window + grace (+ slack)
    assert loop.server_died_at is None
    assert all(s.result or s.error for s in loop.sent)  # every request ended one way or the other


def test_a_healthy_server_completes_requests_with_ttft():
    server = _Server(ok=10**6, then="stall")
    try:
        t0 = time.monotonic()
        loop = _run(server, lambda: True)
        assert time.monotonic() - t0 < 1.5 + 1.0 + 5.0 + 2.0
    finally:
        server.close()
    row = summarize("x", 2, loop, {}, 32, 0)
    assert row["requests"]["completed"] > 5 and row["requests"]["failed"] == 0
    assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p50"] is not None
    assert loop.server_died_at is None and not loop.notes


@pytest.mark.parametrize("then", ["stall", "drop"])
def test_a_server_that_dies_mid_run_is_reported_and_the_run_ends(then):
    server = _Server(ok=8, then=then)
    try:
        t0 = time.monotonic()
        loop = _run(server, lambda: False, duration=20.0)  # alive() is asked after a failure: "gone"
        took = time.monotonic() - t0
    finally:
        server.close()
    assert took < 20.0  # it stopped at the failure, not at the window's end
    row = summarize("x", 2, loop, {}, 32, 0)
    done = row["requests"]["completed"] + sum(1 for s in loop.sent if s.phase == "warmup" and s.result)
    assert 0 < done <= 8
    assert row["requests"]["failed"] + sum(1 for s in loop.sent if s.phase == "warmup" and s.error) >= 1
    assert loop.server_died_at is not None and "the server is gone" in loop.notes[0]
    if then == "stall":
        assert any("no bytes for" in (s.error or "") for s in loop.sent)


def test_prompt_token_ids_are_numpy_free():
    """The request body is JSON: token ids must be plain ints (numpy's are not serialisable)."""
    s = trace([[1, 2]])
    p = PromptBuilder(Scaling()).prompt(s, next(inline(s.trace.steps)), 1, 0)
    json.dumps(p.tokens)
    assert not any(isinstance(t, np.integer) for t in p.tokens)


def test_itl_counts_the_servers_tokens_not_stream_events():
    """AIPerf's ITL: (last token - first token) / (output tokens - 1), tokens as the server's usage counts them
    (an event may carry several); interactivity p90 is the tail rate (1 / ITL p90)."""
    from kvtier.bench.agentx.client import Completion
    from kvtier.bench.agentx.report import _record, interactivity
    from kvtier.bench.agentx.loop import Sent

    s = Sent(0, 1, "window", [], 40, 5, 10.0,
             result=Completion(10.0, events=[10.1, 10.5], completion_tokens=5, done=10.5))
    r = _record(s)
    assert r["ttft_ms"] == pytest.approx(100.0) and r["itl_ms"] == pytest.approx(100.0) and r["osl"] == 5
    rates = interactivity([10.0] * 9 + [100.0])
    assert rates["p50"] == pytest.approx(100.0) and rates["p90"] < rates["p50"]


def test_a_failed_start_is_told_by_its_root_cause():
    from kvtier.bench.agentx import startup_error

    log = ("(APIServer pid=1) WARNING [x.py:1] fd limit errors like `OSError: [Errno 24] Too many open files`\n"
           "(Worker pid=2) ERROR [m.py:9] Exception: CPU Offloading is currently only supported on CUDA-alike GPUs\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert startup_error(log) == "Exception: CPU Offloading is currently only supported on CUDA-alike GPUs"
    assert startup_error("ModuleNotFoundError: No module named 'lmcache'") == \
        "ModuleNotFoundError: No module named 'lmcache'"
