"""The trace reading of the GPU timeline tool (benchmarks/timeline.py) and of bench_decode.py's device time
(benchmarks/device_trace.py), on synthetic Perfetto traces: only the device's stream activities count, calls split
at the widest gap, kernel, copy, busy and idle time with overlapping activities counted once."""
from .helpers import load_benchmark


def _timeline():
    return load_benchmark("timeline")


def _device_trace():
    return load_benchmark("device_trace")


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
    # the span each activity adds past all before it (idle gaps with the activity after them): copy 10, gather
    # 2 + 20, solve 3 (5 of its 8 us overlap the gather), write 3 + 2; together the span
    added = text.split("span added by activity")[1].splitlines()[1:]
    got = {line.split()[-1]: float(line.split()[0]) for line in added}
    assert got == {"MemcpyD2D": 10.0, "sdm::gather": 22.0, "sdm::solve": 3.0, "sdm::write": 5.0}, got


def _decode_trace(steps):
    """`steps` decode steps 100 us apart. The device's process has two CUDA streams and a line of XLA ops that spans
    each step's kernels; per step: a 4 us kernel on one stream, and on the other a copy [2, 6] and a kernel [3, 5]
    that overlap the first kernel. Host events and an instant event on the device must be ignored."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 11, "args": {"name": "Stream #14(Compute,Memcpy)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 12, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 20, "args": {"name": "python"}}]
    events = []
    for i in range(steps):
        base = 100.0 * i
        events += [
            {"ph": "X", "pid": 1, "tid": 10, "name": "void sdm::decode_step(int)", "ts": base, "dur": 4.0},
            {"ph": "X", "pid": 1, "tid": 11, "name": "MemcpyD2D", "ts": base + 2.0, "dur": 4.0},
            {"ph": "X", "pid": 1, "tid": 11, "name": "void sdm::side(int)", "ts": base + 3.0, "dur": 2.0},
            {"ph": "X", "pid": 1, "tid": 12, "name": "custom-call.1", "ts": base - 1.0, "dur": 10.0},
            {"ph": "i", "pid": 1, "tid": 10, "name": "marker", "ts": base + 50.0},
            {"ph": "X", "pid": 2, "tid": 20, "name": "PjitFunction(step)", "ts": base, "dur": 60.0},
        ]
    return {"traceEvents": meta + events}


def test_activity_time_per_step():
    dt = _device_trace()
    steps = 3
    events, processes = dt.device_events(_decode_trace(steps))
    assert processes == ["/device:GPU:0", "/host:CPU"]
    # the two streams' events only: not the XLA ops line, the instant event or the host's
    assert len(events) == 3 * steps and {name for *_, name, _ in events} == {
        "void sdm::decode_step(int)", "MemcpyD2D", "void sdm::side(int)"}
    kernel_us, busy_us, kernels = dt.activity_time(events)
    # per step: kernels [0, 4] and [3, 5] cover 5 us (a plain sum would give 6); with the copy [2, 6] the device is
    # busy 6 us; the 94 us between steps are idle, not device time (the span would be 206 us)
    assert (kernel_us / steps, busy_us / steps, kernels / steps) == (5.0, 6.0, 2.0)


def test_union_length_and_no_device():
    dt = _device_trace()
    # unsorted, nested and overlapping: [0, 12] covered, [20, 21] apart
    assert dt.union_length([(5.0, 12.0), (0.0, 10.0), (2.0, 3.0), (20.0, 21.0)]) == 13.0
    assert dt.union_length([]) == 0.0
    assert dt.activity_time([]) == (0.0, 0.0, 0)
    # the CPU backend's trace: host threads only, no device events (bench_decode.py then reports n/a)
    host_only = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "tid": 1, "name": "tf_XLAEigen", "ts": 0.0, "dur": 30.0}]}
    events, processes = dt.device_events(host_only)
    assert events == [] and processes == ["/host:CPU"]
    assert not any(dt.is_device(p) for p in processes)
