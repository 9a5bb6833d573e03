// Every XLA FFI target of jax_sdm, declared once: its name, the stem of its handler symbols (Sdm<stem>Cpu in
// ffi/*_cpu.cc, Sdm<stem>Cuda in ffi/*_cuda.cc) and its buffer list (ffi/common.h SDM_FFI_PARAMS). The extension
// modules (ffi/cpu_module.cc, ffi/cuda_module.cc) register the handlers under these names and describe each
// target's operands, attributes and results to Python (DefineInterfaces), so that jax_sdm/ffi_ops.py passes and
// reads them by name; they also give it the workspace sizes the handlers check.
#ifndef JAX_SDM_FFI_TARGETS_H_
#define JAX_SDM_FFI_TARGETS_H_

#include <nanobind/nanobind.h>

#include <cstdint>
#include <initializer_list>

#include "ffi/chunk_steps_common.h"
#include "ffi/decode_step_common.h"
#include "ffi/phase1_common.h"
#include "ffi/product_key_topk_common.h"
#include "ffi/solve_common.h"
#include "ffi/token_recurrence_common.h"
#include "kernels/chunk_steps.h"
#include "kernels/decode_step.h"
#include "kernels/phase1.h"

// X(P, name, stem, LIST) for every target, P passed through (the platform's symbol suffix).
#define SDM_FFI_TARGETS(X, P)                                              \
  X(P, "sdm_phase1", Phase1, SDM_PHASE1_BUFFERS)                           \
  X(P, "sdm_phase1_bwd", Phase1Bwd, SDM_PHASE1_BWD_BUFFERS)                \
  X(P, "sdm_solve", Solve, SDM_SOLVE_BUFFERS)                              \
  X(P, "sdm_forward", Forward, SDM_FORWARD_BUFFERS)                        \
  X(P, "sdm_backward", Backward, SDM_BACKWARD_BUFFERS)                     \
  X(P, "sdm_forward_packed", ForwardPacked, SDM_FORWARD_PACKED_BUFFERS)    \
  X(P, "sdm_forward_slab", ForwardSlab, SDM_FORWARD_SLAB_BUFFERS)          \
  X(P, "sdm_backward_packed", BackwardPacked, SDM_BACKWARD_PACKED_BUFFERS) \
  X(P, "sdm_decode_step", DecodeStep, SDM_DECODE_BUFFERS)                  \
  X(P, "sdm_layer_decode_step", LayerDecodeStep, SDM_LAYER_DECODE_BUFFERS) \
  X(P, "sdm_layer_decode_rank_step", LayerDecodeRankStep, SDM_LAYER_DECODE_RANK_BUFFERS) \
  X(P, "sdm_product_key_topk", ProductKeyTopk, SDM_PKTOPK_BUFFERS)         \
  X(P, "sdm_product_key_topk_bwd", ProductKeyTopkBwd, SDM_PKTOPK_BWD_BUFFERS)

// The targets of the CPU alone: the no-grad forward as the token recurrence (ffi/token_recurrence_cpu.cc).
#define SDM_FFI_CPU_TARGETS(X, P) X(P, "sdm_token_recurrence", TokenRecurrence, SDM_TOKEN_RECURRENCE_BUFFERS)

// The handler symbols of platform P (Cpu or Cuda), and their capsules by target name in the dict `d`.
#define SDM_FFI_DECLARE_HANDLER(P, name, stem, LIST) extern "C" XLA_FFI_Error* Sdm##stem##P(XLA_FFI_CallFrame*);
#define SDM_FFI_CAPSULE(P, name, stem, LIST) d[name] = ::nanobind::capsule(reinterpret_cast<void*>(&Sdm##stem##P));

// Defines registrations() in module m: {target name: the capsule of its handler of platform P}, for
// jax.ffi.register_ffi_target(..., platform=`platform`); ONLY(X, P) adds the platform's own targets.
#define SDM_FFI_NO_TARGETS(X, P)
#define SDM_FFI_DEFINE_REGISTRATIONS(m, P, platform, ONLY)                                               \
  m.def(                                                                                                 \
      "registrations",                                                                                   \
      [] {                                                                                               \
        ::nanobind::dict d;                                                                              \
        SDM_FFI_TARGETS(SDM_FFI_CAPSULE, P)                                                              \
        ONLY(SDM_FFI_CAPSULE, P)                                                                         \
        return d;                                                                                        \
      },                                                                                                 \
      "Returns {target name: PyCapsule} for jax.ffi.register_ffi_target(..., platform='" platform "').")

namespace sdm_ffi {

// One entry of a buffer list, as Python sees it: its kind ("Arg", "Ret", "Attr" or "Rest") and name.
struct BufferName {
  const char* kind;
  const char* name;
};
#define SDM_FFI_DESCRIBE(kind, T, name) ::sdm_ffi::BufferName{#kind, #name}
#define SDM_FFI_DESCRIBE_TARGET(P, name, stem, LIST) \
  d[name] = Describe({LIST(SDM_FFI_DESCRIBE, SDM_FFI_COMMA)});

inline nanobind::tuple Describe(std::initializer_list<BufferName> buffers) {
  nanobind::list out;
  for (const BufferName& b : buffers) out.append(nanobind::make_tuple(b.kind, b.name));
  return nanobind::tuple(out);
}

// Adds to module m what Python needs to call the targets: interfaces() ({target name: ((kind, name), ...)}, the
// buffer lists in order), phase1_workspace_bytes (kernels/phase1.h) and chunk_steps_workspace_floats
// (kernels/chunk_steps.h), the sizes of the workspace results the handlers check.
inline void DefineInterfaces(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "interfaces",
      [] {
        nb::dict d;
        SDM_FFI_TARGETS(SDM_FFI_DESCRIBE_TARGET, _)
        SDM_FFI_CPU_TARGETS(SDM_FFI_DESCRIBE_TARGET, _)
        return d;
      },
      "Returns {target name: ((kind, name), ...)}: each target's operands (Arg), attributes (Attr), results (Ret) "
      "and optional remaining results (Rest), in the handler's order.");
  // The layer's decode step ranks its lists in its CUDA kernel up to these (kernels/decode_step.h).
  m.attr("layer_decode_rank_max_factors") = sdm::kLayerRankMaxFactors;
  m.attr("layer_decode_rank_max_k") = sdm::kLayerRankMaxK;
  m.def("phase1_workspace_bytes", &sdm::phase1_cuda_workspace_bytes, nb::arg("N"), nb::arg("C"), nb::arg("W"),
        nb::arg("R"), nb::arg("backward"),
        "Bytes of the workspace result of sdm_phase1 / sdm_phase1_bwd for N units (0 when the CUDA kernels' scratch "
        "fits in shared memory).");
  m.def(
      "chunk_steps_workspace_floats",
      [](int64_t V, int64_t NC, int64_t P, int64_t C, int64_t W, int64_t R, int64_t K, int64_t D, bool backward) {
        const sdm::StepDims dm{V, NC, P, C, W, R, K, D};
        return backward ? sdm::backward_workspace_floats(dm) : sdm::forward_workspace_floats(dm);
      },
      nb::arg("V"), nb::arg("NC"), nb::arg("P"), nb::arg("C"), nb::arg("W"), nb::arg("R"), nb::arg("K"),
      nb::arg("D"), nb::arg("backward"),
      "Floats of the workspace result of the chunk-step targets (sdm_forward*: backward=False).");
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_TARGETS_H_
