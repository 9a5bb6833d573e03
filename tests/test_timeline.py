"""scripts/timeline.py's trace reading (the GPU timeline tool): on a synthetic Perfetto trace with two calls, it
keeps only the device's activities, splits the calls at the widest gap, and counts kernel, copy and idle time with
overlapping activities counted once."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _timeline():
    spec = importlib.util.spec_from_file_location("timeline", ROOT / "scripts" / "timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(offset):
    """Two calls `offset` us apart on the device, plus host events that must be ignored."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    events = []
    for base in (0.0, offset):
        events += [
            {"ph": "X", "pid": 1, "name": "MemcpyD2D", "ts": base, "dur": 10.0},
            {"ph": "X", "pid": 1, "name": "void sdm::gather(int)", "ts": base + 12.0, "dur": 20.0},
            # overlaps the gather by 5 us (a kernel launched early): busy time counts it once
            {"ph": "X", "pid": 1, "name": "void sdm::solve(int)", "ts": base + 27.0, "dur": 8.0},
            {"ph": "X", "pid": 1, "name": "void sdm::write(int)", "ts": base + 38.0, "dur": 2.0},
            {"ph": "X", "pid": 2, "name": "host work", "ts": base + 1.0, "dur": 500.0},
        ]
    return {"traceEvents": meta + events}


def test_device_events_calls_and_summary():
    tl = _timeline()
    events, processes = tl.device_events(_trace(1000.0))
    assert sorted(processes) == ["/device:GPU:0", "/host:CPU"]
    assert len(events) == 8 and all(kind in ("kernel", "copy") for *_, kind in events)
    assert [kind for *_, kind in events[:4]] == ["copy", "kernel", "kernel", "kernel"]
    calls = tl.split_calls(events, 2)
    assert [len(c) for c in calls] == [4, 4] and calls[1][0][0] == 1000.0
    span, text = tl.summarize(calls[0])
    assert span == 40.0
    first = text.splitlines()[0]
    # kernels: 20 (gather) + 3 (solve past the gather) + 2 (write) = 25; copies 10; idle 2 + 3 = 5 in 2 gaps
    assert "kernels      25.0 us" in first and "copies/memsets     10.0 us" in first
    assert "idle      5.0 us in 2 gaps" in first
    assert "sdm::gather" in text and "MemcpyD2D -> sdm::gather" in text
