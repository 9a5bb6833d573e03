"""Rewrites a CUDA source (kernels/phase1_cuda.cu, a file of kernels/chunk_steps/) for the host emulation (cuda_emu.h; the
CUDA headers are the shims in shim/): the block's shared arrays (one block runs at a time, so static ones are
plain statics and the dynamic one is the launch's buffer), inline PTX (prefetch hints: a one-byte read of their
address on the host; the tensor cores' product: cuda_emu.h's emulation; the rest goes) and
the kernel launches `kernel<...><<<grid, block, smem, stream>>>(args)`.

    python3 transform.py IN.cu OUT.inc [LAUNCHES]

LAUNCHES, when given, is the number of launches the source must have (a check that it did not change shape); any
construct the rewrite does not know (a `__shared__` or `asm` left, a launch not rewritten) stops it."""
import re
import sys

s = open(sys.argv[1]).read()
s = s.replace("#include <cuda_runtime.h>", '#include "cuda_emu.h"')
# extern __shared__ [__align__(N)] T name[];  ->  T* name = (T*) the launch's dynamic shared memory
s = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];",
           r"\1* \2 = reinterpret_cast<\1*>(emu::dyn_smem());", s)
# __shared__ [__align__(N)] T name[...];  ->  a static of the block (one block runs at a time)
s = re.sub(r"\b__shared__\s+__align__\((\d+)\)\s+", r"alignas(\1) static ", s)
s = re.sub(r"\b__shared__\s+", "static ", s)
# prefetch hints read one byte of their address (ASan finds one outside the buffers), other inline PTX goes
s = re.sub(r'asm\s+volatile\s*\("prefetch\.global\.L[12] \[%0\];"\s*::\s*"l"\((.*?)\)\);', r"emu::touch(\1);", s,
           flags=re.S)
s = re.sub(r'asm\s+volatile\s*\(".*?"\s*::.*?\);', ";", s, flags=re.S)
# the tensor cores' product (dense.cuh mma_tf32) becomes cuda_emu.h's emulation
s = re.sub(r'asm\s+volatile\s*\(\s*"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32[^"]*"\s*'
           r':\s*"\+f"\((\w+)\[0\]\).*?:\s*"r"\((\w+)\[0\]\).*?"r"\((\w+)\[0\]\).*?\);',
           lambda m: f"emu::mma_tf32({m[1]}, {m[2]}, {m[3]});" + "\n" * m[0].count("\n"), s, flags=re.S)
s, n = re.subn(r"(\w+(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(", r"emu::launch(\1, \2, ", s, flags=re.S)
assert "__shared__" not in s and "asm" not in s and "<<<" not in s, f"{sys.argv[1]} changed shape: update transform.py"
if len(sys.argv) > 3:
    assert n == int(sys.argv[3]), f"{sys.argv[1]}: {n} launches, expected {sys.argv[3]}: update transform.py"
# Diagnostics (sanitizer reports, compiler errors) name the CUDA source's own lines: the rewrite keeps every line.
open(sys.argv[2], "w").write(f'#line 1 "{sys.argv[1]}"\n' + s)
