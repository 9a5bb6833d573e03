// nanobind module jax_sdm._sdm_cpu: the CPU FFI handlers as capsules.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* SdmPhase1Cpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmPhase1BwdCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmSolveCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmForwardCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmBackwardCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmForwardPackedCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmBackwardPackedCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmDecodeStepCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmTokenRecurrenceCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmProductKeyTopkCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SdmProductKeyTopkBwdCpu(XLA_FFI_CallFrame* call_frame);

NB_MODULE(_sdm_cpu, m) {
  m.doc() = "jax_sdm CPU kernels as XLA FFI handlers (platform 'cpu').";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["sdm_phase1"] = nb::capsule(reinterpret_cast<void*>(&SdmPhase1Cpu));
        d["sdm_phase1_bwd"] = nb::capsule(reinterpret_cast<void*>(&SdmPhase1BwdCpu));
        d["sdm_solve"] = nb::capsule(reinterpret_cast<void*>(&SdmSolveCpu));
        d["sdm_forward"] = nb::capsule(reinterpret_cast<void*>(&SdmForwardCpu));
        d["sdm_backward"] = nb::capsule(reinterpret_cast<void*>(&SdmBackwardCpu));
        d["sdm_forward_packed"] = nb::capsule(reinterpret_cast<void*>(&SdmForwardPackedCpu));
        d["sdm_backward_packed"] = nb::capsule(reinterpret_cast<void*>(&SdmBackwardPackedCpu));
        d["sdm_decode_step"] = nb::capsule(reinterpret_cast<void*>(&SdmDecodeStepCpu));
        d["sdm_token_recurrence"] = nb::capsule(reinterpret_cast<void*>(&SdmTokenRecurrenceCpu));
        d["sdm_product_key_topk"] = nb::capsule(reinterpret_cast<void*>(&SdmProductKeyTopkCpu));
        d["sdm_product_key_topk_bwd"] = nb::capsule(reinterpret_cast<void*>(&SdmProductKeyTopkBwdCpu));
        return d;
      },
      "Returns {target name: PyCapsule} for jax.ffi.register_ffi_target(..., "
      "platform='cpu').");
}
