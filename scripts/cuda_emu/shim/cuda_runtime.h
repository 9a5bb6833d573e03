// The CUDA runtime header, for the host emulation (scripts/cuda_emu): cuda_emu.h.
#pragma once
#include "cuda_emu.h"
