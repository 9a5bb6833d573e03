// Phase 1 of the chunked SDM forward (docs/DESIGN.md "Phase 1"; docs/MATH.md "Chunked form", "Phase 1").
//
// Plain C++ on raw, contiguous (row-major) arrays: no XLA types. One *unit* is one
// chunk of one stream; units are independent. Shapes (all row-major):
//
//   inputs   k_idx, k_val, x          [N, C, W]   (int32, float32, float32)
//            q_idx, q_val             [N, C, R]   (int32, float32)
//   outputs  log_k, rex, cpe, k_eff, w   [N, C, W]  float32
//            log_q, q_w                  [N, C, R]  float32
//            A, QK                       [N, C, C]  float32
//            w_order [N, C*W], w_group [N, C*W + 1]   int32
//            r_order [N, C*R], r_group [N, C*R + 1]   int32
//            repeats [N]                              int32
//
// Every output element is written. The result is deterministic and does not depend
// on the thread count (units are split over threads in contiguous blocks; each unit
// is computed by one thread in a fixed order).
#ifndef JAX_SDM_KERNELS_PHASE1_H_
#define JAX_SDM_KERNELS_PHASE1_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace sdm {

struct Phase1Dims {
  int64_t N, C, W, R, K;  // units, tokens per unit, write lanes, read lanes, slots
  int64_t lanes() const { return W + R; }          // a token's write lanes, then its read lanes
  int64_t entries() const { return C * lanes(); }  // entries of one unit
};

// Phase 1's arrays (shapes above); unit(u, ...) is the same set advanced to unit u.
struct Phase1Arrays {
  const int32_t* k_idx;
  const float* k_val;
  const float* x;
  const int32_t* q_idx;
  const float* q_val;
  float* log_k;
  float* rex;
  float* cpe;
  float* k_eff;
  float* w;
  float* log_q;
  float* q_w;
  float* A;
  float* QK;
  int32_t* w_order;
  int32_t* w_group;
  int32_t* r_order;
  int32_t* r_group;
  int32_t* repeats;

  SDM_HOST_DEVICE Phase1Arrays unit(int64_t u, int64_t C, int64_t W, int64_t R) const {
    const int64_t cw = u * C * W, cr = u * C * R, cc = u * C * C;
    return {k_idx + cw, k_val + cw, x + cw, q_idx + cr, q_val + cr, log_k + cw, rex + cw, cpe + cw, k_eff + cw,
            w + cw, log_q + cr, q_w + cr, A + cc, QK + cc, w_order + cw, w_group + u * (C * W + 1),
            r_order + cr, r_group + u * (C * R + 1), repeats + u};
  }
};

// The Phase-1 backward's arrays (shapes at phase1_bwd_cpu); unit(u, ...) as above.
struct Phase1GradArrays {
  const int32_t* k_idx;
  const float* k_val;
  const float* x;
  const int32_t* q_idx;
  const float* q_val;
  const float* log_k;
  const float* rex;
  const float* cpe;
  const float* log_q;
  const float* dk_eff;
  const float* dw;
  const float* dcpe;
  const float* dq_w;
  const float* dA;
  const float* dQK;
  float* dk_val;
  float* dx;
  float* dq_val;

  SDM_HOST_DEVICE Phase1GradArrays unit(int64_t u, int64_t C, int64_t W, int64_t R) const {
    const int64_t cw = u * C * W, cr = u * C * R, cc = u * C * C;
    return {k_idx + cw,  k_val + cw, x + cw,      q_idx + cr, q_val + cr, log_k + cw,
            rex + cw,    cpe + cw,   log_q + cr,  dk_eff + cw, dw + cw,   dcpe + cw,
            dq_w + cr,   dA + cc,    dQK + cc,    dk_val + cw, dx + cw,   dq_val + cr};
  }
};

// Requirements (checked by the caller): N, C, W, R, K >= 0, C * (W + R) < 2^31,
// K <= 2^31 - 1. May throw std::bad_alloc (scratch).
void phase1_cpu(const Phase1Arrays& a, const Phase1Dims& dims);

// The VJP of phase1_cpu with respect to k_val, x and q_val (docs/DESIGN.md
// "Phase-1 backward"), given Phase 1's inputs, the outputs it needs and the
// cotangents of k_eff, w, cpe, q_w, A and QK (those of log_k, rex, log_q are 0):
//
//   inputs   k_idx, k_val, x               [N, C, W]  (int32, float32, float32)
//            q_idx, q_val                  [N, C, R]  (int32, float32)
//            log_k, rex, cpe               [N, C, W]  Phase 1's outputs
//            log_q                         [N, C, R]  Phase 1's output
//            dk_eff, dw, dcpe              [N, C, W]  cotangents
//            dq_w                          [N, C, R]
//            dA, dQK                       [N, C, C]  (only the strictly lower part
//                                                      of dA and the lower part of
//                                                      dQK are read)
//   outputs  dk_val, dx                    [N, C, W]  float32
//            dq_val                        [N, C, R]  float32
//
// The pair terms' exponents are summed again from the gates x (never taken as
// differences of log_k / log_q, which cancel: -inf - -inf = NaN).
// Invalid entries get 0, and so do the gates of repeats. Deterministic, float32,
// independent of the thread count. Same requirements as phase1_cpu.
void phase1_bwd_cpu(const Phase1GradArrays& a, const Phase1Dims& dims);

}  // namespace sdm

// ---------------------------------------------------------------------------
// CUDA (kernels/phase1_cuda.cu)
// ---------------------------------------------------------------------------

// The CUDA runtime's stream handle type is `CUstream_st*` (cudaStream_t); declared here so that this header
// needs no CUDA include.
struct CUstream_st;

namespace sdm {

// Per-unit scratch of the CUDA kernels (kernels/phase1_cuda.cu: the entries' slots, the sort buffers, the run
// sums and links, per-warp counters and rows), placed from the shapes only (Phase1ScratchPlace): all of it in
// dynamic shared memory when it is at most kPhase1CudaSharedBytes; else, when the rest fits there, the run arrays
// (the run sums, and in the backward the runs' log gradients) in a global workspace and the rest in shared
// memory; else all of it in the workspace. With a workspace the kernels run at most kPhase1CudaGlobalBlocks
// blocks, one slice each. The extension modules export phase1_cuda_workspace_bytes (ffi/targets.h): Python sizes
// the workspace result with it.
constexpr int64_t kPhase1CudaSharedBytes = 226 * 1024;  // sm_90 gives a block 227 KB, less the kernels' static 512 B
constexpr int64_t kPhase1CudaGlobalBlocks = 128;
// Warps per block of the CUDA kernels (32 * kPhase1CudaWarps threads).
constexpr int64_t kPhase1CudaWarps = 32;
// Largest C * (W + R) the CUDA kernels take.
constexpr int64_t kPhase1CudaMaxEntries = int64_t{1} << 22;

enum Phase1ScratchPlace : int { kScratchShared = 0, kScratchRunsGlobal = 1, kScratchGlobal = 2 };

inline int64_t phase1_round_up(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// 4 bytes per warp and max(256, 2 C) (radix counters, then rows of A and QK), plus 12 bytes per entry
// (E = C * (W + R): slot, two sort buffers), rounded up to 256: the part that always lives with the rest.
inline int64_t phase1_cuda_base_bytes(int64_t C, int64_t W, int64_t R) {
  const int64_t per_warp = 2 * C > 256 ? 2 * C : 256;
  return phase1_round_up(4 * (kPhase1CudaWarps * per_warp + 3 * C * (W + R)));
}

// The run arrays: 4 bytes per entry in the forward (run sum), 8 in the backward (and the run's log gradient).
inline int64_t phase1_cuda_run_bytes(int64_t C, int64_t W, int64_t R, bool backward) {
  return phase1_round_up(4 * (backward ? 2 : 1) * C * (W + R));
}

inline int64_t phase1_cuda_scratch_bytes(int64_t C, int64_t W, int64_t R, bool backward) {
  return phase1_cuda_base_bytes(C, W, R) + phase1_cuda_run_bytes(C, W, R, backward);
}

inline Phase1ScratchPlace phase1_cuda_scratch_place(int64_t C, int64_t W, int64_t R, bool backward) {
  if (phase1_cuda_scratch_bytes(C, W, R, backward) <= kPhase1CudaSharedBytes) return kScratchShared;
  return phase1_cuda_base_bytes(C, W, R) <= kPhase1CudaSharedBytes ? kScratchRunsGlobal : kScratchGlobal;
}

// Bytes of a block's slice of the workspace: 0, the run arrays, or the whole scratch.
inline int64_t phase1_cuda_slice_bytes(int64_t C, int64_t W, int64_t R, bool backward) {
  switch (phase1_cuda_scratch_place(C, W, R, backward)) {
    case kScratchShared: return 0;
    case kScratchRunsGlobal: return phase1_cuda_run_bytes(C, W, R, backward);
    default: return phase1_cuda_scratch_bytes(C, W, R, backward);
  }
}

// Bytes of the workspace the CUDA kernels need for N units: 0 when the scratch fits in shared memory.
inline int64_t phase1_cuda_workspace_bytes(int64_t N, int64_t C, int64_t W, int64_t R, bool backward) {
  const int64_t slice = phase1_cuda_slice_bytes(C, W, R, backward);
  if (N <= 0 || slice == 0) return 0;
  return (N < kPhase1CudaGlobalBlocks ? N : kPhase1CudaGlobalBlocks) * slice;
}

// phase1_cpu and phase1_bwd_cpu on the GPU: the same arrays (to float32 rounding; the integer maps exactly),
// bitwise reproducible. Enqueued on `stream`; no allocation, no synchronisation, launch configuration from the
// shapes only. `workspace` (16-byte aligned) holds at least phase1_cuda_workspace_bytes(N, C, W, R, backward)
// bytes (may be null when that is 0). Requires C * (W + R) <= kPhase1CudaMaxEntries and K <= 2^31 - 1.
// Returns the cudaError_t of the launch (cudaErrorInvalidValue for a workspace too small or sizes out of
// range), 0 on success; N == 0 launches nothing.
int phase1_cuda(const Phase1Arrays& a, const Phase1Dims& dims, void* workspace, int64_t workspace_bytes,
                CUstream_st* stream);
int phase1_bwd_cuda(const Phase1GradArrays& a, const Phase1Dims& dims, void* workspace, int64_t workspace_bytes,
                    CUstream_st* stream);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_PHASE1_H_
