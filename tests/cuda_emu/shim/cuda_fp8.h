// The CUDA float8 header, for the host emulation (tests/cuda_emu): the one conversion the kernels use, float pairs to
// float8 e4m3 with finite saturation as the PTX ISA documents cvt.rn.satfinite.e4m3x2.f32 (the first value in the
// low byte): round to nearest, ties to the even code; magnitudes that round past the largest finite value 448
// (infinities included) give +-448; NaN gives NaN (0x7f here). Worked out by a search over the codes' values, not
// by bits as kernels/snapshot_codec.h's float8_e4m3_of: a check of that function as well as of the kernels.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cuda_emu.h"

typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

namespace emu {
// The magnitude of positive e4m3 code c (0 to 0x7e): subnormals m 2^-9, normals (8 + m) 2^(e - 10).
inline double e4m3_value(int c) {
  const int e = c >> 3, m = c & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}
inline unsigned e4m3_satfinite(float x) {
  if (std::isnan(x)) return 0x7f;
  const unsigned sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));  // every difference below is exact in double
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double dc = std::fabs(e4m3_value(c) - a), db = std::fabs(e4m3_value(best) - a);
    if (dc < db || (dc == db && c % 2 == 0)) best = c;  // a tie is between neighbours: the even code
  }
  return sign | static_cast<unsigned>(best);
}
}  // namespace emu

inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat, __nv_fp8_interpretation_t t) {
  if (sat != __NV_SATFINITE || t != __NV_E4M3) {
    std::fprintf(stderr, "cuda_fp8.h emulation: only __NV_SATFINITE and __NV_E4M3\n");
    std::abort();
  }
  return static_cast<__nv_fp8x2_storage_t>(emu::e4m3_satfinite(x.x) | emu::e4m3_satfinite(x.y) << 8);
}
