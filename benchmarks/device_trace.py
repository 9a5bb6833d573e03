"""Reading the device's activity out of a `jax.profiler` trace (used by bench_decode.py and timeline.py).

`record(run)` traces one call of `run()` and returns the trace (the Chrome/Perfetto JSON the profiler writes);
`device_events(trace)` keeps the complete events on the device's streams; `activity_time(events)` measures how long
the device was busy in kernels and in all activities, overlapping activities counted once.
"""
import glob
import gzip
import json
import os
import tempfile

import jax


def record(run, trace_dir=None, perfetto=False):
    """Call `run()` under `jax.profiler` and return the trace it wrote (a dict). `run` must wait for its results
    (`jax.block_until_ready`) so that the device's work lies inside the trace. Without `trace_dir` the trace goes to
    a temporary directory, removed afterwards; `perfetto` also writes a file for ui.perfetto.dev."""
    with tempfile.TemporaryDirectory(prefix="sdm_trace_") as tmp:
        where = trace_dir or tmp
        jax.profiler.start_trace(where, create_perfetto_trace=perfetto)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(where, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {where}")
        with gzip.open(max(files, key=os.path.getmtime)) as f:
            return json.load(f)


def is_device(process_name):
    # XLA's profiler names a GPU's process /device:GPU:n; the CPU backend records only /host:CPU (threads on the host)
    return "GPU" in process_name or "gpu" in process_name


def device_events(trace):
    """The trace's complete events ("X") on the device's streams, as (start us, end us, name, kind) sorted by start,
    kind "copy" for memcpy/memset and "kernel" otherwise; and the names of all processes in the trace.

    A process counts as the device's when its name says GPU. Inside it, when some threads are named "Stream ..."
    (the CUDA streams, as XLA's CUPTI tracer names them), only their events count: the device's other lines are
    not device work (CUPTI's overhead) or repeat the streams' time (lines of XLA ops spanning their kernels)."""
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if is_device(name)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in gpu}
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    events = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        name = e.get("name", "")
        low = name.lower()
        kind = "copy" if "memcpy" in low or "memset" in low else "kernel"
        events.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name, kind))
    events.sort()
    return events, sorted(names.values())


def union_length(intervals):
    """Total length covered by (start, end) intervals: overlapping stretches count once."""
    total, frontier = 0.0, float("-inf")
    for s, e in sorted(intervals):
        total += max(0.0, e - max(s, frontier))
        frontier = max(frontier, e)
    return total


def activity_time(events):
    """(kernel_us, busy_us, kernels): the time the device spent running kernels, the time it spent on any
    activity (kernels, copies, memsets), each with overlapping activities (several streams) counted once, and the
    number of kernel events. Idle gaps between activities are not counted: this is device time, not the span."""
    kernels = [(s, e) for s, e, _, kind in events if kind == "kernel"]
    return union_length(kernels), union_length([(s, e) for s, e, _, _ in events]), len(kernels)
