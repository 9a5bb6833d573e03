"""Compiled memory of the op at an anchor shape: XLA's buffer assignment (`compile().memory_analysis()`) for the
no-grad forward and the one-jit forward + backward of `bench.py`, in GiB. Compiles only (runs nothing), so it
works on any backend for any shape:

    python benchmarks/memory.py [--shape flagship] [--chunk 64] [--impl ffi] [--snapshot-dtype int4] [--hlo DIR]

`peak` is arguments + outputs + temporaries - aliased bytes: what the call holds at most on the device besides
the runtime's own buffers.
"""
import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import SHAPES, make_functions


def abstract_inputs(shape):
    dt = jnp.bfloat16 if shape["dtype"] == "bfloat16" else jnp.float32
    B, T, H, K, D, W, R = (shape[k] for k in ("B", "T", "H", "K", "D", "W", "R"))
    S = jax.ShapeDtypeStruct
    args = [S((B, H, K, D), dt), S((B, T, H, W), jnp.int32), S((B, T, H, W), dt), S((B, T, H, D), dt),
            S((B, T, H), jnp.float32), S((B, T, H), jnp.float32), S((B, T, H, R), jnp.int32), S((B, T, H, R), dt)]
    return args, S(args[3].shape, dt), S(args[0].shape, dt)  # the cotangents: arguments of the grad (bench.py)


def main(argv=None, place=None):
    """`place`: a function that places the abstract arguments on a device (deviceless.py: the H200 described)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="flagship", choices=sorted(SHAPES))
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--impl", default="ffi")
    ap.add_argument("--T", type=int, help="override the shape's sequence length")
    ap.add_argument("--nograd-only", action="store_true", help="only the no-grad forward")
    ap.add_argument("--hlo", help="write each compiled module's text here")
    ap.add_argument("--loss", choices=["y+bank", "y"], default="y+bank",
                    help="bench.py's training loss (y: the readings only, no bank-sized cotangent)")
    ap.add_argument("--snapshot-dtype", choices=["bfloat16", "float8_e4m3fn", "int4"],
                    help="sdm_write_read's snapshot_dtype (default: the bank's dtype)")
    a = ap.parse_args(argv)
    shape = dict(SHAPES[a.shape])
    if a.T:
        shape["T"] = a.T
    chunk = a.chunk or shape["chunk"]
    args, dy, dbank = abstract_inputs(shape)
    if place is not None:
        args, dy, dbank = place((args, dy, dbank))
    fwd, grad = make_functions(a.impl, chunk, dy, None if a.loss == "y" else dbank, a.snapshot_dtype)
    gib = 2.0**30
    where = jax.devices()[0].platform if place is None else "the H200 described by deviceless.py"
    print(f"{a.impl} {a.shape} T {shape['T']} chunk {chunk} on {where}, loss {a.loss}, "
          f"snapshot {a.snapshot_dtype or 'the bank dtype'}")
    for name, fn in (("no-grad fwd", fwd), ("fwd+bwd (one jit)", grad))[:1 if a.nograd_only else 2]:
        compiled = fn.lower(*args).compile()
        m = compiled.memory_analysis()
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
        print(f"  {name:18s} args {m.argument_size_in_bytes / gib:6.3f}  out {m.output_size_in_bytes / gib:6.3f}  "
              f"temp {m.temp_size_in_bytes / gib:6.3f}  alias {m.alias_size_in_bytes / gib:6.3f}  "
              f"peak {peak / gib:6.3f} GiB")
        if a.hlo:
            Path(a.hlo).mkdir(parents=True, exist_ok=True)
            (Path(a.hlo) / f"{a.shape}_{name.split()[0]}.txt").write_text(compiled.as_text())


if __name__ == "__main__":
    main()
