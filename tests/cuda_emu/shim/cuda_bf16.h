// The CUDA bfloat16 header, for the host emulation (tests/cuda_emu): __nv_bfloat16 is in cuda_emu.h.
#pragma once
#include "cuda_emu.h"
