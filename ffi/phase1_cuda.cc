// XLA FFI handlers `sdm_phase1` and `sdm_phase1_bwd` (platform CUDA): the checks, buffers and attribute of the CPU
// handlers (ffi/phase1_common.h, same order and shapes, any leading batch dims whose product is N), then
// kernels/phase1_cuda.cu on XLA's stream. An optional trailing result is a workspace (any dtype and shape,
// counted in bytes) of at least sdm::phase1_cuda_workspace_bytes(N, C, W, R, backward) bytes: the kernels'
// scratch when it does not fit in shared memory; it may be left out when that is 0 (the CPU handlers accept it
// too and ignore it; jax_sdm/ffi_ops.py always passes it). No allocation, no host synchronisation, launch
// configuration from the shapes only: safe to capture in a CUDA graph (kCmdBufferCompatible).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ffi/cuda_common.h"
#include "ffi/phase1_common.h"
#include "kernels/phase1.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The CUDA kernels' limit: C * (W + R) at most kPhase1CudaMaxEntries.
ffi::Error CudaLimits(const char* op, const sdm::Phase1Dims& u) {
  if (u.C * (u.W + u.R) > sdm::kPhase1CudaMaxEntries) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": C * (W + R) = " + std::to_string(u.C * (u.W + u.R)) +
        " exceeds the CUDA kernel's limit of " + std::to_string(sdm::kPhase1CudaMaxEntries) + " (C=" +
        std::to_string(u.C) + ", W=" + std::to_string(u.W) + ", R=" + std::to_string(u.R) + ")");
  }
  return ffi::Error::Success();
}

// The optional trailing result: the workspace (any type and shape, counted in bytes). It must hold
// phase1_cuda_workspace_bytes(...) bytes; it may be left out when that is 0.
ffi::Error GetWorkspace(const char* op, const ffi::RemainingRets& rest, const sdm::Phase1Dims& u,
                        bool backward, void** data, int64_t* bytes) {
  *data = nullptr;
  *bytes = 0;
  if (rest.size() > 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": expected at most one result after the outputs " +
                                       "(the workspace), got " + std::to_string(rest.size()));
  }
  if (rest.size() == 1) {
    auto ws = rest.get<ffi::AnyBuffer>(0);
    if (ws.has_error()) return ws.error();
    *data = (*ws)->untyped_data();
    *bytes = static_cast<int64_t>((*ws)->size_bytes());
  }
  const int64_t need = sdm::phase1_cuda_workspace_bytes(u.N, u.C, u.W, u.R, backward);
  if (*bytes < need) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace has " + std::to_string(*bytes) +
                                       " bytes, expected at least " + std::to_string(need) +
                                       " (kernels/phase1.h phase1_cuda_workspace_bytes)");
  }
  if (need > 0 && reinterpret_cast<uintptr_t>(*data) % 16 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace is not 16-byte aligned");
  }
  return ffi::Error::Success();
}

ffi::Error Phase1CudaImpl(cudaStream_t stream, SDM_FFI_PARAMS(SDM_PHASE1_BUFFERS)) {
  constexpr const char* op = "sdm_phase1 (CUDA)";
  sdm::Phase1Dims u;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1Args(op, CudaLimits, SDM_FFI_NAMES(SDM_PHASE1_BUFFERS), &u));
  void* ws;
  int64_t ws_bytes;
  SDM_RETURN_IF_ERROR(GetWorkspace(op, workspace, u, /*backward=*/false, &ws, &ws_bytes));
  const int rc =
      sdm::phase1_cuda(sdm_ffi::Phase1ArraysOf(SDM_FFI_NAMES(SDM_PHASE1_BUFFERS)), u, ws, ws_bytes, stream);
  return sdm_ffi::CudaStatus(op, rc);
}

ffi::Error Phase1BwdCudaImpl(cudaStream_t stream, SDM_FFI_PARAMS(SDM_PHASE1_BWD_BUFFERS)) {
  constexpr const char* op = "sdm_phase1_bwd (CUDA)";
  sdm::Phase1Dims u;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1BwdArgs(op, CudaLimits, SDM_FFI_NAMES(SDM_PHASE1_BWD_BUFFERS), &u));
  void* ws;
  int64_t ws_bytes;
  SDM_RETURN_IF_ERROR(GetWorkspace(op, workspace, u, /*backward=*/true, &ws, &ws_bytes));
  const int rc = sdm::phase1_bwd_cuda(sdm_ffi::Phase1GradArraysOf(SDM_FFI_NAMES(SDM_PHASE1_BWD_BUFFERS)), u, ws,
                                      ws_bytes, stream);
  return sdm_ffi::CudaStatus(op, rc);
}

}  // namespace

SDM_CUDA_HANDLER(SdmPhase1Cuda, Phase1CudaImpl, SDM_PHASE1_BUFFERS);
SDM_CUDA_HANDLER(SdmPhase1BwdCuda, Phase1BwdCudaImpl, SDM_PHASE1_BWD_BUFFERS);
