// nanobind module jax_sdm._sdm_cuda: the CUDA FFI handlers as capsules.
#include <nanobind/nanobind.h>

#include "kernels/chunk_steps.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* SdmSolveCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmForwardCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmBackwardCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmForwardPackedCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmBackwardPackedCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmPhase1Cuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmPhase1BwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmDecodeStepCuda(XLA_FFI_CallFrame* call_frame);

NB_MODULE(_sdm_cuda, m) {
  m.doc() = "jax_sdm CUDA kernels as XLA FFI handlers (platform 'CUDA').";
  // The build's SDM_CUDA_PDL option (kernels/chunk_steps.h).
  m.attr("programmatic_dependent_launch") = sdm::kChunkStepsPdl;
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["sdm_solve"] = nb::capsule(reinterpret_cast<void*>(&SdmSolveCuda));
        d["sdm_forward"] = nb::capsule(reinterpret_cast<void*>(&SdmForwardCuda));
        d["sdm_backward"] = nb::capsule(reinterpret_cast<void*>(&SdmBackwardCuda));
        d["sdm_forward_packed"] = nb::capsule(reinterpret_cast<void*>(&SdmForwardPackedCuda));
        d["sdm_backward_packed"] = nb::capsule(reinterpret_cast<void*>(&SdmBackwardPackedCuda));
        d["sdm_phase1"] = nb::capsule(reinterpret_cast<void*>(&SdmPhase1Cuda));
        d["sdm_phase1_bwd"] = nb::capsule(reinterpret_cast<void*>(&SdmPhase1BwdCuda));
        d["sdm_decode_step"] = nb::capsule(reinterpret_cast<void*>(&SdmDecodeStepCuda));
        return d;
      },
      "Returns {target name: PyCapsule} for jax.ffi.register_ffi_target(..., "
      "platform='CUDA').");
}
