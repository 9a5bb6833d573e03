"""One forward + backward of an anchor shape (bench.py's training step), or with `nograd` its no-grad forward, for
a kernel profiler (ncu) to time each kernel (`scripts/gpu_check.sh profile` runs it under ncu):

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/profile_steps.py flagship [chunk] [grad|nograd]
"""
import sys

import jax

from bench import SHAPES, make_functions, make_inputs

shape = dict(SHAPES[sys.argv[1] if len(sys.argv) > 1 else "flagship"])
if len(sys.argv) > 2:
    shape["chunk"] = int(sys.argv[2])
args, dy, dbank = make_inputs(shape, 0)
forward, step = make_functions("ffi", shape["chunk"], dy, dbank)
fn = forward if len(sys.argv) > 3 and sys.argv[3] == "nograd" else step
jax.block_until_ready(fn(*args))
