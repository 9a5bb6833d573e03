// The CUDA runtime header, for the host emulation (tests/cuda_emu): cuda_emu.h.
#pragma once
#include "cuda_emu.h"
