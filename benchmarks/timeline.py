"""A device timeline of bench.py's calls (the stand-in for an nsys timeline: nsys is not on the GPU machine):
where the wall time of one call goes between kernels, copies and idle gaps.

    python3 benchmarks/timeline.py [shape] [chunk] [grad|nograd|inplace] [--calls N] [--trace-dir DIR]
                                   [--snapshot-dtype D]

Runs the function a few times to warm up, then `--calls` times under `jax.profiler` (a Perfetto trace with the
device's activity), and prints for the median call: its span on the device (first activity to last), the time
in kernels, in copies and memsets, the idle time between activities, the largest gaps and which activities they
sit between, and the time each kind of activity takes in all. `inplace` is the no-grad forward with
`in_place=True` and the bank donated, each call taking the previous call's bank (bench.py's "in place" columns).
"""
import argparse
import collections
import statistics
import time

import jax

from jax_sdm import sdm_write_read

from bench import SHAPES, ThreadedBank, make_functions, make_inputs, warm_up
from device_trace import device_events, is_device, record


def split_calls(events, calls):
    """Cut the event list into `calls` groups at the `calls - 1` widest idle gaps (the host's waits between calls)."""
    if calls <= 1 or len(events) < calls:
        return [events]
    gaps, frontier = [], events[0][1]
    for i in range(1, len(events)):
        gaps.append((events[i][0] - frontier, i))
        frontier = max(frontier, events[i][1])
    cuts = sorted(i for _, i in sorted(gaps)[-(calls - 1):])
    bounds = [0] + cuts + [len(events)]
    return [events[a:b] for a, b in zip(bounds, bounds[1:])]


def short(name, width=48):
    name = name.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "")
    return name if len(name) <= width else name[:width - 3] + "..."


def summarize(call):
    start, end = call[0][0], max(e[1] for e in call)
    busy = collections.Counter()
    per_name = collections.defaultdict(lambda: [0, 0.0])
    # The span each kind of activity adds past the end of everything before it: under programmatic dependent
    # launch a kernel starts before its predecessor ends, so its own duration overstates what it costs the call.
    adds = collections.Counter()
    gaps = []
    frontier = start
    previous = "(start)"
    for s, e, name, kind in call:
        if s > frontier:
            gaps.append((s - frontier, previous, name))
        # Busy time: the union of activities (overlapping streams count once).
        busy[kind] += max(0.0, e - max(s, frontier))
        adds[short(name)] += max(0.0, e - frontier)
        frontier = max(frontier, e)
        previous = name
        per_name[short(name)][0] += 1
        per_name[short(name)][1] += e - s
    idle = sum(g for g, _, _ in gaps)
    lines = [f"span {end - start:9.1f} us   kernels {busy['kernel']:9.1f} us   copies/memsets {busy['copy']:8.1f} us"
             f"   idle {idle:8.1f} us in {len(gaps)} gaps (mean {idle / max(len(gaps), 1):.2f} us)"]
    pairs = collections.defaultdict(lambda: [0, 0.0])
    for g, a, b in gaps:
        pairs[(short(a, 32), short(b, 32))][0] += 1
        pairs[(short(a, 32), short(b, 32))][1] += g
    lines.append("idle time by neighbours (after -> before), largest first:")
    for (a, b), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:12]:
        lines.append(f"  {t:8.1f} us in {n:4d} gaps   {a} -> {b}")
    lines.append("largest single gaps:")
    for g, a, b in sorted(gaps, reverse=True)[:8]:
        lines.append(f"  {g:8.1f} us   {short(a, 32)} -> {short(b, 32)}")
    lines.append("time by activity:")
    for name, (n, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:20]:
        lines.append(f"  {t:9.1f} us  {n:4d} x  {name}")
    lines.append("span added by activity (past the end of all before it; idle gaps included):")
    for name, t in adds.most_common(20):
        lines.append(f"  {t:9.1f} us  {per_name[name][0]:4d} x  {name}")
    return end - start, "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="flagship", choices=sorted(SHAPES))
    ap.add_argument("chunk", nargs="?", type=int)
    ap.add_argument("mode", nargs="?", default="grad", choices=["grad", "nograd", "inplace"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--trace-dir")
    ap.add_argument("--snapshot-dtype", choices=["bfloat16", "float8_e4m3fn", "int4"],
                    help="sdm_write_read's snapshot_dtype (default: the bank's dtype)")
    a = ap.parse_args()
    shape = dict(SHAPES[a.shape])
    if a.chunk:
        shape["chunk"] = a.chunk
    args, dy, dbank = make_inputs(shape, 0)
    forward, step = make_functions("ffi", shape["chunk"], dy, dbank, a.snapshot_dtype)
    fn = forward if a.mode == "nograd" else step
    if a.mode == "inplace":
        fn = ThreadedBank(lambda bank, *rest: sdm_write_read(bank, *rest, chunk_size=shape["chunk"], impl="ffi",
                                                             snapshot_dtype=a.snapshot_dtype, in_place=True), args[0])
        args = args[1:]
    warm_up(fn, args)
    walls = []

    def traced():
        for _ in range(a.calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            walls.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.002)  # a clear gap between calls on the device

    events, processes = device_events(record(traced, a.trace_dir, perfetto=True))
    print(f"{a.shape} chunk {shape['chunk']} {a.mode} snapshot {a.snapshot_dtype or 'bank'} on {jax.devices()[0].device_kind}: wall per call (host) "
          f"median {statistics.median(walls):.1f} us over {a.calls} calls")
    if not events:
        print("no device activity in the trace; processes:", processes)
        return
    print("device activity from:", ", ".join(p for p in processes if is_device(p)))
    calls = split_calls(events, a.calls)
    spans = [summarize(c) for c in calls]
    spans.sort(key=lambda s: s[0])
    print(f"device span per call: {', '.join(f'{s:.0f}' for s, _ in spans)} us; the median call:")
    print(spans[len(spans) // 2][1])


if __name__ == "__main__":
    main()
