// bfloat16 storage for the CPU kernels: bank rows are read into float32 and rounded back once per
// written row (docs/MATH.md "Determinism and numerics"), round-to-nearest-even like XLA's convert.
#ifndef JAX_SDM_KERNELS_BF16_H_
#define JAX_SDM_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace sdm {

// The bits of a float32 rounded to bfloat16, to nearest even (a NaN stays a NaN), and the float32 of such bits:
// the one definition of the rounding, for the bank's rows and the bfloat16 snapshot (kernels/snapshot_codec.h).
SDM_HOST_DEVICE inline uint16_t bf16_bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
SDM_HOST_DEVICE inline float float_of_bf16_bits(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return float_of_bf16_bits(x.bits); }

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16 from_float<bf16>(float f) { return bf16{bf16_bits_of(f)}; }

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_BF16_H_
