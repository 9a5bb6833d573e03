// How the forward stores the snapshot, the pre-write row of each write group (docs/MATH.md "Snapshot storage"):
// the one definition of its codes for the CPU and CUDA kernels. kBank keeps the bank's dtype (exact); kBf16 rounds
// each element to bfloat16; kFloat8 and kInt4 store each element as a code of x * (1 / scale), with one float32
// scale per row, the row's largest magnitude over the code's largest value (a maximum is exact, so the scale is the
// same whatever order a kernel takes the elements in), and its reciprocal rounded once per row (a product per
// element instead of a division). The backward restores the row from the decoded values, code * scale.
#ifndef JAX_SDM_KERNELS_SNAPSHOT_CODEC_H_
#define JAX_SDM_KERNELS_SNAPSHOT_CODEC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.h"
#include "kernels/host_device.h"

namespace sdm {

// The codes' numbers are those jax_sdm/kernel_path.py passes as the `snapshot_dtype` attribute.
enum class SnapshotDtype : int32_t { kBank = 0, kBf16 = 1, kFloat8 = 2, kInt4 = 3 };

SDM_HOST_DEVICE inline bool snapshot_scaled(SnapshotDtype t) {
  return t == SnapshotDtype::kFloat8 || t == SnapshotDtype::kInt4;
}

// The bytes of one stored row of D elements (`bank_elem` bytes per element of the bank): int4 packs two elements a
// byte, element d in byte d / 2, the even one in the low nibble.
SDM_HOST_DEVICE inline int64_t snapshot_row_bytes(SnapshotDtype t, int64_t D, int64_t bank_elem) {
  switch (t) {
    case SnapshotDtype::kBf16: return 2 * D;
    case SnapshotDtype::kFloat8: return D;
    case SnapshotDtype::kInt4: return (D + 1) / 2;
    default: return bank_elem * D;
  }
}

// float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinities): the largest finite value.
constexpr float kFloat8Max = 448.f;
// int4: symmetric codes -7..7 (-8 unused, so that the range is the same on both sides).
constexpr float kInt4Max = 7.f;

// A row's scale from its largest magnitude: 0 for a zero row (every code then 0).
SDM_HOST_DEVICE inline float snapshot_scale(SnapshotDtype t, float amax) {
  return amax / (t == SnapshotDtype::kFloat8 ? kFloat8Max : kInt4Max);
}

// x (|x| <= 448 after scaling) as float8 e4m3fn, rounded to nearest even; larger magnitudes saturate at 448, NaN
// gives the NaN code 0x7f.
SDM_HOST_DEVICE inline uint8_t float8_e4m3_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7f;
  float a;
  std::memcpy(&a, &mag, 4);
  if (a < 0.015625f)  // below the smallest normal 2^-6: subnormal steps of 2^-9 (a * 512 is exact)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * 512.f)));
  // Keep 3 mantissa bits, rounding the 20 dropped ones to nearest even, and rebias the exponent (127 to 7).
  const uint32_t r = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
  const uint32_t code = r - (120u << 3);
  return static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code));
}

SDM_HOST_DEVICE inline float float_of_float8_e4m3(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  float a;
  if (e == 0) {
    a = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    const uint32_t bits = ((e + 120u) << 23) | (m << 20);
    std::memcpy(&a, &bits, 4);
  }
  return (c & 0x80u) ? -a : a;
}

// x (|x| <= 7 after scaling) to the nearest int4 code (ties to even), as a nibble (two's complement).
SDM_HOST_DEVICE inline uint8_t int4_of(float x) {
  const float q = fminf(fmaxf(rintf(x), -kInt4Max), kInt4Max);
  return static_cast<uint8_t>(static_cast<int>(q) & 0xf);
}

SDM_HOST_DEVICE inline float float_of_int4(uint8_t nibble) {
  return static_cast<float>(nibble >= 8 ? static_cast<int>(nibble) - 16 : static_cast<int>(nibble));
}

// The reciprocal of a row's scale, float32 (0 for a zero row), and x times it: the value x's code rounds.
SDM_HOST_DEVICE inline float snapshot_inverse(float scale) { return scale > 0.f ? 1.f / scale : 0.f; }
SDM_HOST_DEVICE inline float snapshot_scaled_value(float x, float inverse) { return inverse > 0.f ? x * inverse : 0.f; }

// The code of x in a row whose scale has the reciprocal `inverse` (kFloat8: a byte; kInt4: a nibble), and the
// value a code stands for in a row of scale `scale`.
SDM_HOST_DEVICE inline uint8_t snapshot_encode(SnapshotDtype t, float x, float inverse) {
  const float y = snapshot_scaled_value(x, inverse);
  return t == SnapshotDtype::kFloat8 ? float8_e4m3_of(y) : int4_of(y);
}

SDM_HOST_DEVICE inline float snapshot_decode(SnapshotDtype t, uint8_t code, float scale) {
  return (t == SnapshotDtype::kFloat8 ? float_of_float8_e4m3(code) : float_of_int4(code)) * scale;
}

// Element d of a stored row (kBf16, kFloat8, kInt4) as float32.
SDM_HOST_DEVICE inline float snapshot_element(SnapshotDtype t, const uint8_t* row, int64_t d, float scale) {
  if (t == SnapshotDtype::kBf16) {
    uint16_t bits;
    std::memcpy(&bits, row + 2 * d, 2);
    return float_of_bf16_bits(bits);
  }
  if (t == SnapshotDtype::kFloat8) return snapshot_decode(t, row[d], scale);
  return snapshot_decode(t, static_cast<uint8_t>((row[d / 2] >> (4 * (d & 1))) & 0xf), scale);
}

// Byte b of a stored row (kBf16, kFloat8, kInt4) from the row's elements, elem(d) as float32 (D of them): every
// byte has one writer, so a warp can store a row byte by byte, a lane a byte.
// `inverse`: snapshot_inverse of the row's scale.
template <typename Elem>
SDM_HOST_DEVICE inline uint8_t snapshot_byte(SnapshotDtype t, int64_t b, int64_t D, float inverse, Elem elem) {
  if (t == SnapshotDtype::kBf16) return static_cast<uint8_t>(bf16_bits_of(elem(b / 2)) >> (8 * (b & 1)));
  if (t == SnapshotDtype::kFloat8) return snapshot_encode(t, elem(b), inverse);
  const uint8_t lo = snapshot_encode(t, elem(2 * b), inverse);
  const uint8_t hi = 2 * b + 1 < D ? snapshot_encode(t, elem(2 * b + 1), inverse) : 0;
  return static_cast<uint8_t>(lo | (hi << 4));
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_SNAPSHOT_CODEC_H_
