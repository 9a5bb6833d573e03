// XLA FFI handler `sdm_solve` (platform cpu): Minv = (I + diag(beta) A)^{-1}
// per unit (docs/DESIGN.md "Solve").
#include <cstdint>
#include <string>

#include "kernels/solve.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

ffi::Error SolveCpuImpl(ffi::Buffer<ffi::F32> A, ffi::Buffer<ffi::F32> beta,
                        ffi::ResultBuffer<ffi::F32> Minv) {
  auto ad = A.dimensions();
  auto bd = beta.dimensions();
  auto md = Minv->dimensions();
  if (ad.size() != 3 || ad[1] != ad[2]) {
    return ffi::Error::InvalidArgument(
        "sdm_solve: A must have shape [N, C, C], got " + DimsToString(ad));
  }
  const int64_t N = ad[0], C = ad[1];
  if (bd.size() != 2 || bd[0] != N || bd[1] != C) {
    return ffi::Error::InvalidArgument(
        "sdm_solve: beta must have shape [N, C] = [" + std::to_string(N) +
        ", " + std::to_string(C) + "], got " + DimsToString(bd));
  }
  if (md.size() != 3 || md[0] != N || md[1] != C || md[2] != C) {
    return ffi::Error::InvalidArgument(
        "sdm_solve: the result Minv must have the shape of A " +
        DimsToString(ad) + ", got " + DimsToString(md));
  }
  try {
    sdm::solve_cpu(A.typed_data(), beta.typed_data(), N, C, Minv->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("sdm_solve: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSolveCpu, SolveCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // Minv
);
