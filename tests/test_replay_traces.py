"""Trace readers: both formats, the shipped sample, and errors that name the file and the line or request."""

import gzip
import importlib.resources
import json

import numpy as np
import pytest

from kvtier.tools.replay.traces import Subagents, TraceError, TraceRequest, read_agentic, read_mooncake, read_trace
from kvtier.tools.replay.workload import Workload, load_workload
from replaykit import req, sub


def write_agentic(path, requests, **top):
    doc = {"id": "t", "block_size": 64, "requests": requests, **top}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def test_agentic_tree_ids_and_delays(tmp_path):
    reqs = [req([7, 8, 9], extra_tokens=5, t=0.0, api=2.0),
            sub([req([100, 101])], t=30.0, duration=20.0),  # spawned at 10 s: 8 s after r0 ended at 2 s
            sub([req([200]), req([200, 201], think=3.0)], t=33.0, duration=25.0),  # spawned at 8 s
            req([7, 8, 9, 10], t=40.0, think=38.0),  # 7 s after the last subagent finished (33 s)
            req([7, 8], t=50.0, think=4.5)]
    t = read_agentic(write_agentic(tmp_path / "a.json.gz", reqs))
    assert (t.name, t.block_tokens, t.timed, t.requests) == ("t", 64, False, 6)
    r0, group, r1, r2 = t.steps
    assert isinstance(group, Subagents) and len(group.agents) == 2
    assert group.spawn_delays == pytest.approx((8.0, 6.0))
    assert (r0.delay, r1.delay, r2.delay) == pytest.approx((0.0, 7.0, 4.5))
    assert group.agents[1][1].delay == 3.0
    assert r0.input_tokens == 3 * 64 + 5 and len(r0.blocks) == 3  # the partial block is not cacheable
    # Dense ids: one per distinct trace id, shared wherever the trace id repeats.
    assert t.unique_blocks == 8 and sorted(t.raw_ids.tolist()) == [7, 8, 9, 10, 100, 101, 200, 201]
    assert r1.blocks[:3].tolist() == r0.blocks.tolist() and r2.blocks.tolist() == r0.blocks[:2].tolist()
    assert all(r.blocks.dtype == np.int32 for r in t.iter_requests())
    assert t.block_accesses == 3 + 2 + 1 + 2 + 4 + 2 and t.input_tokens == sum(r.input_tokens
                                                                              for r in t.iter_requests())


def test_think_time_falls_back_to_timestamps(tmp_path):
    r0, r1 = req([1], t=0.0, api=2.0), req([1, 2], t=10.0)
    del r1["think_time"]
    t = read_agentic(write_agentic(tmp_path / "a.json", [r0, r1]))
    assert t.steps[1].delay == pytest.approx(8.0)


def test_mooncake_reader(tmp_path):
    p = tmp_path / "m.jsonl"
    lines = [{"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
             {"timestamp": 1000, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    t = read_trace(p)
    assert t.timed and t.block_tokens == 512 and t.requests == 2
    first, second = t.steps  # issued in time order
    assert isinstance(first, TraceRequest) and first.delay == 1.0 and second.delay == 2.0
    assert len(first.blocks) == 1 and len(second.blocks) == 2  # 600 // 512 and 1100 // 512 full blocks
    assert first.blocks[0] == second.blocks[0]  # id 0 is global across the file


@pytest.mark.parametrize("content, message", [
    ('{"id": "x", "requests": [', "bad.json: line 1, column"),
    ('{"id": "x"}', "bad.json: not an agentic-cc trace"),
    ('{"requests": [{"t": 0, "in": 128, "out": 1}]}', "bad.json: requests[0]: missing 'hash_ids'"),
    ('{"requests": [{"t": 0, "in": 640, "hash_ids": [1, 2]}]}', "requests[0]: 2 hash_ids for 640 input tokens"),
    ('{"requests": [{"t": 0, "in": "many", "hash_ids": []}]}', "requests[0]: 'in' must be a non-negative"),
    ('{"requests": [{"t": 0, "in": 128, "hash_ids": [1, 1]}]}', "request 0 repeats a block id"),
    ('{"requests": [{"t": 0, "type": "subagent", "requests": [{"t": 0, "in": 64, "hash_ids": ["a"]}]}]}',
     "requests[0].requests[0]: hash_ids must be integers"),
    ('{"block_size": 0, "requests": []}', "block_size must be a positive integer"),
])
def test_agentic_errors_name_the_file_and_request(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_agentic(p)


def test_mooncake_errors_name_the_line(tmp_path):
    p = tmp_path / "m.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]})
    p.write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(TraceError, match=r"m.jsonl: line 3: not valid JSON"):
        read_mooncake(p)
    p.write_text(good + "\n" + json.dumps({"input_length": 512, "hash_ids": [0]}) + "\n")
    with pytest.raises(TraceError, match=r"m.jsonl: line 2: 'timestamp' must be a number"):
        read_mooncake(p)
    with pytest.raises(TraceError, match="gone.json: no such trace file"):
        load_workload([tmp_path / "gone.json"])


def test_truncated_gzip_is_a_clear_error(tmp_path):
    p = tmp_path / "cut.json.gz"
    p.write_bytes(gzip.compress(b'{"requests": []}' * 100)[:30])
    with pytest.raises(TraceError, match="cut.json.gz: cannot read"):
        read_agentic(p)


def test_workload_order_salts_and_rules(tmp_path):
    a = write_agentic(tmp_path / "a.json", [req([1, 2])], id="a")
    b = write_agentic(tmp_path / "b.json", [req([1, 2, 3])], id="b")
    w = load_workload([tmp_path], repeat=2, seed=3)
    assert w.unique_blocks == 2 * (2 + 3) and w.requests == 4
    order = [(r.trace.name, r.repeat) for r in w.replays]
    assert sorted(order) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert order == [(r.trace.name, r.repeat) for r in w.replays]  # seeded: the same every time
    offsets = [r.id_offset for r in w.replays]
    assert offsets == sorted(offsets) and len(set(offsets)) == 4
    from kvtier.keys import Namespace
    ns = Namespace("m")
    keys = [set(w.keys(r, ns)) for r in w.replays]
    assert all(not (keys[i] & keys[j]) for i in range(4) for j in range(i + 1, 4))  # salted apart
    assert load_workload([a, b], limit=1).traces[0].name == "a"
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}) + "\n")
    with pytest.raises(TraceError, match="mixed trace formats"):
        load_workload([a, m])
    with pytest.raises(TraceError, match="replays once"):
        Workload([read_trace(m)], repeat=2)


def test_shipped_sample_reads_with_license_and_notice():
    root = importlib.resources.files("kvtier").joinpath("sample-traces", "agentic-cc")
    names = sorted(p.name for p in root.iterdir())
    assert "LICENSE" in names and "NOTICE.md" in names
    assert "Apache License" in root.joinpath("LICENSE").read_text()
    assert "callanjfox/kv-cache-tester" in root.joinpath("NOTICE.md").read_text()
    with importlib.resources.as_file(root) as path:
        w = load_workload([path])
    assert len(w.traces) == len([n for n in names if n.endswith(".json.gz")]) >= 8
    assert any(isinstance(s, Subagents) for t in w.traces for s in t.steps)
