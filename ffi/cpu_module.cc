// nanobind module jax_sdm._sdm_cpu: the CPU FFI handlers as capsules, and the targets' interfaces (ffi/targets.h).
#include <nanobind/nanobind.h>

#include "ffi/targets.h"
#include "xla/ffi/api/c_api.h"

SDM_FFI_TARGETS(SDM_FFI_DECLARE_HANDLER, Cpu)
SDM_FFI_CPU_TARGETS(SDM_FFI_DECLARE_HANDLER, Cpu)

NB_MODULE(_sdm_cpu, m) {
  m.doc() = "jax_sdm CPU kernels as XLA FFI handlers (platform 'cpu').";
  SDM_FFI_DEFINE_REGISTRATIONS(m, Cpu, "cpu", SDM_FFI_CPU_TARGETS);
  sdm_ffi::DefineInterfaces(m);
}
