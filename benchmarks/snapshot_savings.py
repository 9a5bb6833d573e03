"""How much of the snapshot a lossless scheme could leave out: the share of the snapshot's entries (one per write
lane and token, a row's value before its chunk's write) whose row is still the initial bank's, i.e. written for
the first time in the sequence. The backward has the initial bank, so those need no copy. Counts on the
benchmark's own slot ids (`bench.py`'s `make_inputs`: uniform random slots), per anchor shape and sequence length,
against the estimate for uniform ids, `mean over chunks c of exp(-c C W / K)`. Runs on the CPU, nothing on a device:

    python benchmarks/snapshot_savings.py [--shape small,mid,flagship,paper] [--T 4096,16384,32768] [--chunk 128]
"""
import argparse

import numpy as np

from bench import SHAPES
from jax_sdm.testing import random_problem


def first_write_share(k_idx, K, C):
    """The share of valid write entries `k_idx [B, T, H, W]` whose slot no earlier chunk of its stream wrote."""
    B, T, H, W = k_idx.shape
    NC = -(-T // C)
    lossless = total = 0
    for b in range(B):
        for h in range(H):
            ids = k_idx[b, :, h, :]
            chunk = np.repeat(np.arange(T) // C, W).reshape(T, W)
            valid = (ids >= 0) & (ids < K)
            first = np.full(K, NC, np.int64)
            np.minimum.at(first, ids[valid], chunk[valid])
            lossless += int(np.sum(valid & (chunk == np.where(valid, first[np.clip(ids, 0, K - 1)], -1))))
            total += int(np.sum(valid))
    return lossless / max(total, 1)


def uniform_estimate(T, K, C, W):
    NC = -(-T // C)
    return float(np.mean(np.exp(-np.arange(NC) * C * W / K)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small,mid,flagship,paper")
    ap.add_argument("--T", default="", help="comma-separated sequence lengths (default: the shape's)")
    ap.add_argument("--chunk", type=int, default=128)
    a = ap.parse_args(argv)
    print(f"| shape | T | K | W | chunk | first-write share (bench ids) | uniform estimate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in a.shape.split(","):
        s = SHAPES[name]
        for T in [int(t) for t in a.T.split(",") if t] or [s["T"]]:
            dims = dict(B=s["B"], T=T, H=s["H"], K=s["K"], D=1, W=s["W"], R=1)
            k_idx = np.asarray(random_problem(0, **dims)["k_idx"])
            share = first_write_share(k_idx, s["K"], a.chunk)
            print(f"| {name} | {T} | {s['K']} | {s['W']} | {a.chunk} | {share:.3f} | "
                  f"{uniform_estimate(T, s['K'], a.chunk, s['W']):.3f} |")


if __name__ == "__main__":
    main()
