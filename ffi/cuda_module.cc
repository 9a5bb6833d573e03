// nanobind module jax_sdm._sdm_cuda: the CUDA FFI handlers as capsules, the targets' interfaces (ffi/targets.h)
// and the build's options.
#include <nanobind/nanobind.h>

#include "ffi/targets.h"
#include "kernels/chunk_steps.h"
#include "xla/ffi/api/c_api.h"

SDM_FFI_TARGETS(SDM_FFI_DECLARE_HANDLER, Cuda)

NB_MODULE(_sdm_cuda, m) {
  m.doc() = "jax_sdm CUDA kernels as XLA FFI handlers (platform 'CUDA').";
  SDM_FFI_DEFINE_REGISTRATIONS(m, Cuda, "CUDA", SDM_FFI_NO_TARGETS);
  sdm_ffi::DefineInterfaces(m);
  // The build's SDM_CUDA_PDL option (kernels/chunk_steps.h).
  m.attr("programmatic_dependent_launch") = sdm::kChunkStepsPdl;
}
