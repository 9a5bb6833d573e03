// The snapshot of the CUDA chunk steps (docs/MATH.md "The forward chunk step": the snapshot, "Snapshot storage";
// kernels/chunk_steps.h ForwardIO::snapshot): for every unit and write group g, the row of the group's slot as it
// was before the chunk's write, at [unit, g]. In the bank's dtype, the forward's write kernels store it
// (snapshot_store), VEC columns per lane at a time; Phase A reads it as S0 for its dots (a row of the bank's dtype at
// snapshot_row) and puts it back into the bank (snapshot_restore). In another dtype (kernels/snapshot_codec.h) the
// write kernel codes the row from the columns its lanes hold before the write (snapshot_coded_row,
// snapshot_store_codes; where lanes cannot, and with packed sequences, the group's warp re-reads the row:
// snapshot_store_row) and Phase A first restores the bank row from it (snapshot_restore_row), then reads S0 there.
// These functions are the only code that knows how a snapshot row is stored.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_

#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/chunk_steps/device.cuh"
#include "kernels/snapshot_codec.h"

namespace sdm {
namespace {

// What a write kernel knows of its snapshot's dtype: nothing (it asks io), the bank's, or another one (its launch
// picked a kernel of its own for either, so that the bank-dtype one keeps its registers).
enum class SnapshotKernel { kAny, kBank, kCoded };

// Where the forward stores write group g's row of unit u in the bank's dtype; null for a forward without residuals
// or a snapshot of another dtype (snapshot_store_row stores those).
template <typename T, SnapshotKernel kKind = SnapshotKernel::kAny>
__device__ __forceinline__ T* snapshot_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g) {
  if (kKind == SnapshotKernel::kCoded || !io.snapshot) return nullptr;
  if (kKind == SnapshotKernel::kAny && io.snapshot_dtype != SnapshotDtype::kBank) return nullptr;
  return static_cast<T*>(io.snapshot) + (u * dm.C * dm.W + g) * dm.D;
}

// Where the backward reads it (a snapshot of the bank's dtype).
template <typename T>
__device__ __forceinline__ const T* snapshot_row(const BackwardIO& io, const StepDims& dm, int64_t u, int64_t g) {
  return static_cast<const T*>(io.snapshot) + (u * dm.C * dm.W + g) * dm.D;
}

// Where group g's row of unit u starts, in bytes, in a snapshot of another dtype than the bank's (its scale, if any,
// is at u * C * W + g).
__device__ __forceinline__ int64_t snapshot_coded_at(SnapshotDtype t, const StepDims& dm, int64_t u, int64_t g) {
  return (u * dm.C * dm.W + g) * snapshot_row_bytes(t, dm.D, 0);
}

// A snapshot of another dtype than the bank's (bfloat16 of a float32 bank, float8, int4), by the whole warp of the
// row's group before the write changes the row: the row's largest magnitude (a warp maximum, exact in any order),
// its scale (lane 0 stores it), then the coded bytes, a lane a 4-byte word (a byte where rows are not 4-byte
// aligned; snapshot_byte: one writer per byte, two int4 codes in one), read in full before the warp goes on to
// write the row. Nothing for a forward without residuals or a snapshot of the bank's dtype (snapshot_store).
template <typename T>
__device__ __forceinline__ void snapshot_store_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                   const T* row, int lane) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (!io.snapshot || t == SnapshotDtype::kBank) return;
  const int64_t D = dm.D;
  float scale = 0.f;
  if (snapshot_scaled(t)) {
    float amax = 0.f;
    for (int64_t d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_f(row[d])));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = snapshot_scale(t, amax);
    if (lane == 0) io.snapshot_scale[u * dm.C * dm.W + g] = scale;
  }
  const float inverse = snapshot_inverse(scale);
  uint8_t* out = static_cast<uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, u, g);
  const auto elem = [&](int64_t d) { return to_f(row[d]); };
  const int64_t bytes = snapshot_row_bytes(t, D, 0);
  if (bytes % 4 == 0) {  // every row 4-byte aligned: a word per lane (4x fewer store transactions than bytes)
    for (int64_t w = lane; w < bytes / 4; w += 32) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        word |= static_cast<uint32_t>(snapshot_byte(t, 4 * w + i, D, inverse, elem)) << (8 * i);
      reinterpret_cast<uint32_t*>(out)[w] = word;
    }
  } else {
    for (int64_t b = lane; b < bytes; b += 32) out[b] = snapshot_byte(t, b, D, inverse, elem);
  }
  __syncwarp();  // every lane has read the row before any lane writes it
}

// N bytes (1, 2, 4, 8 or 16; p aligned to N) in one access, as little-endian 32-bit words.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (N == 16) {
    uint4 v;
    v.x = w[0], v.y = w[1], v.z = w[2], v.w = w[3];
    *reinterpret_cast<uint4*>(p) = v;
  } else if constexpr (N == 8) {
    uint2 v;
    v.x = w[0], v.y = w[1];
    *reinterpret_cast<uint2*>(p) = v;
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w[0]);
  } else {
    static_assert(N == 1, "1, 2, 4, 8 or 16 bytes");
    *p = static_cast<uint8_t>(w[0]);
  }
}

// Through the read-only path: the backward never writes the snapshot, and the loads may then pass the row's stores.
template <int N>
__device__ __forceinline__ void load_bytes(const uint8_t* p, uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (N == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (N == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (N == 4) {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (N == 2) {
    w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    static_assert(N == 1, "1, 2, 4, 8 or 16 bytes");
    w[0] = __ldg(reinterpret_cast<const unsigned char*>(p));
  }
}

// Whether a lane with VEC consecutive columns holds whole bytes of the coded row (int4 packs two columns a byte):
// then each lane codes and stores its own columns, else the warp stores the row byte by byte (snapshot_store_row).
template <int VEC>
__device__ __forceinline__ bool snapshot_lane_codes(SnapshotDtype t) {
  return VEC % 2 == 0 || t != SnapshotDtype::kInt4;
}

// The bytes of VEC columns of a coded row (kBf16, kFloat8, kInt4 with VEC even) and where column d's start.
template <int VEC>
constexpr int kBf16Bytes = 2 * VEC;
template <int VEC>
constexpr int kFloat8Bytes = VEC;
template <int VEC>
constexpr int kInt4Bytes = VEC / 2 > 0 ? VEC / 2 : 1;

// The float8 codes of two values already over the scale (a in the low byte), float8_e4m3_of's: from sm_89 on the
// hardware's conversion, which rounds to nearest even and saturates finite values at 448 as float8_e4m3_of does, in
// one instruction for both; NaN is set to float8_e4m3_of's 0x7f whatever its sign. Host passes (and the emulation of
// tests/cuda_emu) take the same path.
__device__ __forceinline__ uint32_t float8_e4m3_pair(float a, float b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  float2 ab;
  ab.x = a, ab.y = b;
  uint32_t c = __nv_cvt_float2_to_fp8x2(ab, __NV_SATFINITE, __NV_E4M3);
  if (a != a) c = (c & 0xff00u) | 0x7fu;
  if (b != b) c = (c & 0x00ffu) | 0x7f00u;
  return c;
#else
  return float8_e4m3_of(a) | static_cast<uint32_t>(float8_e4m3_of(b)) << 8;
#endif
}

// A lane's largest magnitude over its columns of a batch (S segments of VEC columns from d0, those below D), from
// `amax` on.
template <int VEC, int S, typename T>
__device__ __forceinline__ float batch_amax(const Cols<VEC, T> (&x)[S], int64_t d0, int64_t D, float amax) {
#pragma unroll
  for (int k = 0; k < S; ++k) {
    if (d0 + k * 32 * VEC >= D) break;
#pragma unroll
    for (int i = 0; i < VEC; ++i) amax = fmaxf(amax, fabsf(x[k][i]));
  }
  return amax;
}

// A write group's row coded from the columns its lanes hold (snapshot_store_codes): where the row's codes start
// (null: nothing to store there) and the reciprocal of its scale (snapshot_inverse).
struct CodedRow {
  uint8_t* out;
  float inverse;
  SnapshotDtype t;
};

// Begins the coded snapshot of group g's row (another dtype than the bank's) by its warp, before the write:
// `lane_amax` is the lane's largest magnitude over its columns of the row (any value where no scale is needed).
// The row's maximum is the warp's (exact in any order, the same as snapshot_store_row's); lane 0 stores the scale.
// Where lanes cannot code their own columns (int4 with VEC odd), the warp stores the row from memory here
// (snapshot_store_row) and the result is null.
template <int VEC, typename T>
__device__ __forceinline__ CodedRow snapshot_coded_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                       const T* row, int lane, float lane_amax) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (!io.snapshot || t == SnapshotDtype::kBank) return CodedRow{nullptr, 0.f, t};
  if (!snapshot_lane_codes<VEC>(t)) {
    snapshot_store_row(io, dm, u, g, row, lane);
    return CodedRow{nullptr, 0.f, t};
  }
  float scale = 0.f;
  if (snapshot_scaled(t)) {
    float amax = lane_amax;
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = snapshot_scale(t, amax);
    if (lane == 0) io.snapshot_scale[u * dm.C * dm.W + g] = scale;
  }
  return CodedRow{static_cast<uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, u, g), snapshot_inverse(scale), t};
}

// Stores the codes of columns [d, d + VEC) of a coded row (cr.out not null) from the lane's columns x, before the
// write: one store of the lane's bytes (the same codes as snapshot_byte's: snapshot_encode, bf16_bits_of).
template <int VEC, typename T>
__device__ __forceinline__ void snapshot_store_codes(const CodedRow& cr, int64_t d, const Cols<VEC, T>& x) {
  if (cr.t == SnapshotDtype::kBf16) {
    uint32_t w[(kBf16Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; ++i) w[i / 2] |= static_cast<uint32_t>(bf16_bits_of(x[i])) << (16 * (i % 2));
    store_bytes<kBf16Bytes<VEC>>(cr.out + 2 * d, w);
  } else if (cr.t == SnapshotDtype::kFloat8) {
    uint32_t w[(kFloat8Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const float a = snapshot_scaled_value(x[i], cr.inverse);
      const float b = i + 1 < VEC ? snapshot_scaled_value(x[i + 1], cr.inverse) : 0.f;
      w[i / 4] |= float8_e4m3_pair(a, b) << (8 * (i % 4));
    }
    if constexpr (VEC == 1) w[0] &= 0xffu;  // the pair's second code is not the lane's
    store_bytes<kFloat8Bytes<VEC>>(cr.out + d, w);
  } else if constexpr (VEC % 2 == 0) {  // int4: column d + i in nibble i of the lane's bytes (d is even)
    uint32_t w[(kInt4Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      w[i / 8] |= static_cast<uint32_t>(snapshot_encode(cr.t, x[i], cr.inverse)) << (4 * (i % 8));
    store_bytes<kInt4Bytes<VEC>>(cr.out + d / 2, w);
  }
}

// The bytes of VEC columns of a row coded as kT (kBf16, kFloat8, or kInt4 with VEC even).
template <SnapshotDtype kT, int VEC>
constexpr int kCodedBytes = kT == SnapshotDtype::kBf16     ? kBf16Bytes<VEC>
                            : kT == SnapshotDtype::kFloat8 ? kFloat8Bytes<VEC>
                                                           : kInt4Bytes<VEC>;

// The value column i of a lane's VEC columns stands for, from their codes `w` as load_bytes gives them (a row coded
// as kT, of scale `scale`).
template <SnapshotDtype kT, int VEC, size_t NW>
__device__ __forceinline__ float coded_value(const uint32_t (&w)[NW], int i, float scale) {
  if constexpr (kT == SnapshotDtype::kBf16)
    return float_of_bf16_bits(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
  else if constexpr (kT == SnapshotDtype::kFloat8)
    return snapshot_decode(kT, static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4))), scale);
  else
    return snapshot_decode(kT, static_cast<uint8_t>((w[i / 8] >> (4 * (i % 8))) & 0xfu), scale);
}

// x rounded to the bank's dtype T, as a float.
__device__ __forceinline__ float rounded_to(float x, const float*) { return x; }
__device__ __forceinline__ float rounded_to(float x, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// VEC columns of a row coded as kT, as a lane of Phase A loads them (one load of their codes) and reads them: the
// values the restore puts back into the bank, decoded and rounded to the bank's dtype T (snapshot_restore_row's).
template <int VEC, typename T, SnapshotDtype kT>
struct CodedCols {
  uint32_t w[(kCodedBytes<kT, VEC> + 3) / 4];
  float scale;
  __device__ __forceinline__ float operator[](int i) const {
    return rounded_to(coded_value<kT, VEC>(w, i, scale), static_cast<const T*>(nullptr));
  }
  __device__ __forceinline__ void store(T* p) const {
    float v[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = coded_value<kT, VEC>(w, i, scale);
    store_cols<VEC>(p, v);
  }
};

// Group g's row of unit u in a snapshot coded as kT, as a source of walk_two_sources (device.cuh RowSource's
// interface): Phase A reads S0 from the codes themselves, with no round trip through the bank row.
template <int VEC, typename T, SnapshotDtype kT>
struct CodedRowSource {
  using ColsT = CodedCols<VEC, T, kT>;
  static constexpr int kCode = kCodedBytes<kT, VEC>;  // the codes' bytes per segment
  // Per segment in walk_two_sources' budget: twice the decoded columns' bytes, for the registers the decoding
  // takes (at VEC 8 of a bfloat16 bank two segments a batch, spilling 40 bytes by ptxas; the codes' own 8 bytes
  // would allow four and spill 136).
  static constexpr int kBytes = 2 * VEC * static_cast<int>(sizeof(T));
  const uint8_t* codes;
  float scale;
  __device__ __forceinline__ CodedRowSource(const BackwardIO& io, const StepDims& dm, int64_t u, int64_t g)
      : codes(static_cast<const uint8_t*>(io.snapshot) + snapshot_coded_at(kT, dm, u, g)),
        scale(snapshot_scaled(kT) ? io.snapshot_scale[u * dm.C * dm.W + g] : 0.f) {}
  __device__ __forceinline__ void load(int64_t d, ColsT& c) const {
    load_bytes<kCode>(codes + d * kCode / VEC, c.w);
    c.scale = scale;
  }
};

// Phase A's restore of a row from a snapshot of another dtype than the bank's, by the whole warp: the decoded
// values rounded to the bank's dtype, which Phase A then reads as S0 from the bank row (the row is complete for
// every lane after the warp barrier). Each lane decodes VEC columns at a time from one load of their codes and
// stores them as one row access (store_cols), a segment at a time (kSegs: batches of several segments in flight
// raise the spills of the Phase A kernels, up to 152 bytes at VEC 8 by ptxas); int4 with VEC odd decodes column by
// column. Returns false, doing nothing, for a snapshot of the bank's dtype (snapshot_restore puts that back column
// by column).
template <int VEC, typename T>
__device__ __forceinline__ bool snapshot_restore_row(const BackwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                     T* row, int lane) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (t == SnapshotDtype::kBank) return false;
  const uint8_t* in = static_cast<const uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, u, g);
  const float scale = snapshot_scaled(t) ? io.snapshot_scale[u * dm.C * dm.W + g] : 0.f;
  const int64_t D = dm.D;
  constexpr int kSegs = 1;
  constexpr int64_t kStep = 32 * VEC;
  const auto walk = [&](auto bytes_of, auto decode) {
    constexpr int N = decltype(bytes_of)::value;
    for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < D; d0 += kSegs * kStep) {
      uint32_t w[kSegs][(N + 3) / 4];
#pragma unroll
      for (int k = 0; k < kSegs; ++k)
        if (d0 + k * kStep < D) load_bytes<N>(in + (d0 + k * kStep) * N / VEC, w[k]);
#pragma unroll
      for (int k = 0; k < kSegs; ++k) {
        if (d0 + k * kStep >= D) break;
        float v[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = decode(w[k], i);
        store_cols<VEC>(row + d0 + k * kStep, v);
      }
    }
  };
  if (t == SnapshotDtype::kBf16) {
    walk(std::integral_constant<int, kBf16Bytes<VEC>>{},
         [](const auto& w, int i) { return coded_value<SnapshotDtype::kBf16, VEC>(w, i, 0.f); });
  } else if (t == SnapshotDtype::kFloat8) {
    walk(std::integral_constant<int, kFloat8Bytes<VEC>>{},
         [&](const auto& w, int i) { return coded_value<SnapshotDtype::kFloat8, VEC>(w, i, scale); });
  } else if constexpr (VEC % 2 == 0) {
    walk(std::integral_constant<int, kInt4Bytes<VEC>>{},
         [&](const auto& w, int i) { return coded_value<SnapshotDtype::kInt4, VEC>(w, i, scale); });
  } else {
    for (int64_t d = lane; d < D; d += 32) from_f(row + d, snapshot_element(t, in, d, scale));
  }
  __syncwarp();
  return true;
}

// Columns [d, d + VEC) of `to` from `from`: a row's columns held in registers (Cols), or a row in memory.
template <int VEC, typename T, typename From>
__device__ __forceinline__ void put_cols(T* to, int64_t d, const From& from) {
  if constexpr (std::is_pointer_v<From>) copy_cols<VEC>(from + d, to + d);
  else from.store(to + d);
}

// Store columns [d, d + VEC) of the row before the write into snapshot row `snap`: `row` is the row's columns as
// loaded (Cols) or the bank row itself.
template <int VEC, typename T, typename Row>
__device__ __forceinline__ void snapshot_store(T* snap, int64_t d, const Row& row) {
  put_cols<VEC>(snap, d, row);
}

// Restore columns [d, d + VEC) of bank row `row` from its snapshot: `snap` is the snapshot's columns as loaded
// (Cols) or snapshot row itself.
template <int VEC, typename T, typename Snap>
__device__ __forceinline__ void snapshot_restore(T* row, int64_t d, const Snap& snap) {
  put_cols<VEC>(row, d, snap);
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
