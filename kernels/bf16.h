// bfloat16 storage for the CPU kernels: bank rows are read into float32 and rounded back once per
// written row (docs/MATH.md "Determinism and numerics"), round-to-nearest-even like XLA's convert.
#ifndef JAX_SDM_KERNELS_BF16_H_
#define JAX_SDM_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

namespace sdm {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16 from_float<bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_BF16_H_
