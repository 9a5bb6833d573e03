"""Rewrites kernels/phase1_cuda.cu for the host emulation (cuda_emu.h): the CUDA runtime include, the block's shared
arrays (one block runs at a time, so they are plain statics / one buffer) and the two kernel launches."""
import re
import sys

s = open(sys.argv[1]).read()
s = s.replace("#include <cuda_runtime.h>", '#include "cuda_emu.h"')
s = s.replace("extern __shared__ __align__(16) unsigned char dyn_smem[];", "unsigned char* dyn_smem = emu::dyn_smem();")
s = s.replace("__shared__ int scan_sh[32 * 4];", "static int scan_sh[32 * 4];")
s, n = re.subn(r"(\w+)<<<(.*?)>>>\(", r"emu::launch(\1, \2, ", s, flags=re.S)
assert n == 2 and "__shared__" not in s, "phase1_cuda.cu changed shape: update transform.py"
open(sys.argv[2], "w").write(s)
