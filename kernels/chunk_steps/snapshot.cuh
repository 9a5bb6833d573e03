// The snapshot of the CUDA chunk steps (docs/MATH.md "The forward chunk step": the snapshot, "Snapshot storage";
// kernels/chunk_steps.h ForwardIO::snapshot): for every unit of a chunk before the last and stored write group g, the
// row of the group's slot as the chunk's write left it, entry StepDims::snapshot_entry(u, g). In the bank's dtype the
// forward's write kernels store it with the row (snapshot_row), VEC columns per lane at a time; in another dtype
// (kernels/snapshot_codec.h) the group's warp reads the written row back and codes it (snapshot_store_row). The
// backward reads a row as it was before a chunk through the links (ForwardIO::link_k, link_q): the snapshot entry, or
// the input bank's row (with_s0_source: a row of the bank's dtype, or a coded row decoded where it is used,
// CodedRowSource). These functions are the only code that knows how a snapshot row is stored.
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
  return static_cast<T*>(io.snapshot) + dm.snapshot_entry(u, g) * dm.D;
}

// Columns [d, d + VEC) of a bank-dtype snapshot row (snapshot_row), as store_cols rounds them. The snapshot is
// read only by the backward, after the whole forward: its stores are streamed (evicted first from the L2), so that
// they do not push out the rows the chunk's next kernels read again. So are the coded snapshot's (store_bytes).
template <int VEC, typename T>
__device__ __forceinline__ void snapshot_store_cols(T* snap, const float* x) {
  store_cols<VEC, T, true>(snap, x);
}

// Where entry `entry`'s row starts, in bytes, in a snapshot of another dtype than the bank's (its scale, if any, is
// at `entry`).
__device__ __forceinline__ int64_t snapshot_coded_at(SnapshotDtype t, const StepDims& dm, int64_t entry) {
  return entry * snapshot_row_bytes(t, dm.D, 0);
}

// The bytes of VEC columns of a coded row (kBf16, kFloat8, kInt4).
template <int VEC>
constexpr int kBf16Bytes = 2 * VEC;
template <int VEC>
constexpr int kFloat8Bytes = VEC;
template <int VEC>
constexpr int kInt4Bytes = VEC / 2 > 0 ? VEC / 2 : 1;

// The bytes of VEC columns of a row coded as kT (kBf16, kFloat8, or kInt4: with VEC odd, the byte that holds the
// lane's column).
template <SnapshotDtype kT, int VEC>
constexpr int kCodedBytes = kT == SnapshotDtype::kBf16     ? kBf16Bytes<VEC>
                            : kT == SnapshotDtype::kFloat8 ? kFloat8Bytes<VEC>
                                                           : kInt4Bytes<VEC>;

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

// N bytes (1, 2, 4, 8 or 16, aligned to N) from the words w, in one streamed store (snapshot_store_cols).
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (N == 16) {
    uint4 v;
    v.x = w[0], v.y = w[1], v.z = w[2], v.w = w[3];
    __stcs(reinterpret_cast<uint4*>(p), v);
  } else if constexpr (N == 8) {
    uint2 v;
    v.x = w[0], v.y = w[1];
    __stcs(reinterpret_cast<uint2*>(p), v);
  } else if constexpr (N == 4) {
    __stcs(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(w[0]));
  } else if constexpr (N == 2) {
    __stcs(reinterpret_cast<unsigned short*>(p), static_cast<unsigned short>(w[0]));
  } else {
    static_assert(N == 1, "1, 2, 4, 8 or 16 bytes");
    __stcs(p, static_cast<unsigned char>(w[0]));
  }
}

// The float8 codes of two values already over the scale (a in the low byte), float8_e4m3_of's: from sm_89 on the
// hardware's conversion, which rounds to nearest even and saturates finite values at 448 as float8_e4m3_of does, one
// instruction for both; NaN is set to float8_e4m3_of's 0x7f whatever its sign. The host (tests/cuda_emu's
// emulation of the conversion) takes the same path.
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

// Stores the codes of columns [d, d + VEC) of a row coded as t (kBf16, kFloat8, or kInt4 with VEC even) from x,
// in one store of the lane's bytes: snapshot_byte's codes (bf16_bits_of, snapshot_encode).
template <int VEC, typename T>
__device__ __forceinline__ void snapshot_store_codes(SnapshotDtype t, uint8_t* out, float inverse, int64_t d,
                                                     const Cols<VEC, T>& x) {
  if (t == SnapshotDtype::kBf16) {
    uint32_t w[(kBf16Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; ++i) w[i / 2] |= static_cast<uint32_t>(bf16_bits_of(x[i])) << (16 * (i % 2));
    store_bytes<kBf16Bytes<VEC>>(out + 2 * d, w);
  } else if (t == SnapshotDtype::kFloat8) {
    uint32_t w[(kFloat8Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const float a = snapshot_scaled_value(x[i], inverse);
      const float b = i + 1 < VEC ? snapshot_scaled_value(x[i + 1], inverse) : 0.f;
      w[i / 4] |= float8_e4m3_pair(a, b) << (8 * (i % 4));
    }
    if constexpr (VEC == 1) w[0] &= 0xffu;  // the pair's second code is not the lane's
    store_bytes<kFloat8Bytes<VEC>>(out + d, w);
  } else if constexpr (VEC % 2 == 0) {  // int4: column d + i in nibble i of the lane's bytes (d is even)
    uint32_t w[(kInt4Bytes<VEC> + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      w[i / 8] |= static_cast<uint32_t>(snapshot_encode(t, x[i], inverse)) << (4 * (i % 8));
    store_bytes<kInt4Bytes<VEC>>(out + d / 2, w);
  }
}

// A snapshot of another dtype than the bank's (bfloat16 of a float32 bank, float8, int4) of group g's written row,
// by the whole warp of the group after the write (the row's columns visible to the warp), each lane over the
// segments of VEC columns it wrote (d = VEC lane + 32 VEC k; VEC divides D): the row's largest magnitude (a warp
// maximum, exact in any order), its scale (lane 0 stores it), then each segment's codes in one store
// (snapshot_store_codes). Int4 with VEC odd (a byte shared by two lanes) goes a byte at a time instead, a lane a
// 4-byte word where rows are 4-byte aligned (one writer per byte: snapshot_byte). Nothing for a forward without
// residuals or a snapshot of the bank's dtype (snapshot_row).
template <int VEC, typename T>
__device__ __forceinline__ void snapshot_store_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                   const T* row, int lane) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (!io.snapshot || t == SnapshotDtype::kBank) return;
  const int64_t D = dm.D, entry = dm.snapshot_entry(u, g), first = static_cast<int64_t>(lane) * VEC;
  const bool by_segment = VEC % 2 == 0 || t != SnapshotDtype::kInt4;
  float scale = 0.f;
  if (snapshot_scaled(t)) {
    float amax = 0.f;
    for (int64_t d = first; d < D; d += 32 * VEC) {
      Cols<VEC, T> x;
      x.load(row + d);
#pragma unroll
      for (int i = 0; i < VEC; ++i) amax = fmaxf(amax, fabsf(x[i]));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = snapshot_scale(t, amax);
    if (lane == 0) __stcs(io.snapshot_scale + entry, scale);
  }
  const float inverse = snapshot_inverse(scale);
  uint8_t* out = static_cast<uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, entry);
  if (by_segment) {
    for (int64_t d = first; d < D; d += 32 * VEC) {
      Cols<VEC, T> x;
      x.load(row + d);
      snapshot_store_codes<VEC>(t, out, inverse, d, x);
    }
    return;
  }
  const auto elem = [&](int64_t d) { return to_f(row[d]); };
  const int64_t bytes = snapshot_row_bytes(t, D, 0);
  if (bytes % 4 == 0) {  // every row 4-byte aligned: a word per lane (4x fewer store transactions than bytes)
    for (int64_t w = lane; w < bytes / 4; w += 32) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        word |= static_cast<uint32_t>(snapshot_byte(t, 4 * w + i, D, inverse, elem)) << (8 * i);
      __stcs(reinterpret_cast<unsigned int*>(out) + w, static_cast<unsigned int>(word));
    }
  } else {
    for (int64_t b = lane; b < bytes; b += 32)
      __stcs(out + b, static_cast<unsigned char>(snapshot_byte(t, b, D, inverse, elem)));
  }
}

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

// VEC columns of a row coded as kT, as a lane of the backward loads them (one load of their codes) and reads them:
// decoded and rounded to the bank's dtype T (the row the backward's S0 stands for).
template <int VEC, typename T, SnapshotDtype kT>
struct CodedCols {
  uint32_t w[(kCodedBytes<kT, VEC> + 3) / 4];
  float scale;
  __device__ __forceinline__ float operator[](int i) const {
    return rounded_to(coded_value<kT, VEC>(w, i, scale), static_cast<const T*>(nullptr));
  }
};

// Entry `entry`'s row in a snapshot coded as kT, as a source of walk_two_sources (device.cuh RowSource's
// interface): the backward reads S0 from the codes themselves.
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
  __device__ __forceinline__ CodedRowSource(const BackwardIO& io, const StepDims& dm, int64_t entry)
      : codes(static_cast<const uint8_t*>(io.snapshot) + snapshot_coded_at(kT, dm, entry)),
        scale(snapshot_scaled(kT) ? io.snapshot_scale[entry] : 0.f) {}
  __device__ __forceinline__ void load(int64_t d, ColsT& c) const {
    if constexpr (kT == SnapshotDtype::kInt4 && VEC % 2 == 1) {  // VEC 1: column d in the low nibble
      c.w[0] = (codes[d / 2] >> (4 * (d & 1))) & 0xfu;
    } else {
      load_bytes<kCode>(codes + d * kCode / VEC, c.w);
    }
    c.scale = scale;
  }
};

// Snapshot entry `entry`'s row as a source of walk_two_sources: a RowSource of the bank's dtype T (kT kBank), or a
// CodedRowSource of kT.
template <int VEC, typename T, SnapshotDtype kT>
__device__ __forceinline__ auto snapshot_source(const BackwardIO& io, const StepDims& dm, int32_t entry) {
  if constexpr (kT == SnapshotDtype::kBank)
    return RowSource<VEC, T>{static_cast<const T*>(io.snapshot) + static_cast<int64_t>(entry) * dm.D};
  else
    return CodedRowSource<VEC, T, kT>(io, dm, entry);
}

// body(source) with S0 of a group of the backward, the row of its slot as it was before the chunk: the snapshot
// entry `link` of a snapshot stored as kT, or for -1 the input bank's row `input_row`. Phase A and the read side
// have a kernel per snapshot dtype, so each compiles two sources' paths (the registers of one).
template <int VEC, typename T, SnapshotDtype kT, typename Body>
__device__ __forceinline__ void with_s0_source(const BackwardIO& io, const StepDims& dm, int32_t link,
                                               const T* input_row, Body body) {
  if (link < 0) return body(RowSource<VEC, T>{input_row});
  return body(snapshot_source<VEC, T, kT>(io, dm, link));
}

// The same with the call's snapshot dtype picked at run time (the packed sequences' kernels: one for every dtype).
template <int VEC, typename T, typename Body>
__device__ __forceinline__ void with_any_s0_source(const BackwardIO& io, const StepDims& dm, int32_t link,
                                                   const T* input_row, Body body) {
  if (link < 0) return body(RowSource<VEC, T>{input_row});
  switch (io.snapshot_dtype) {
    case SnapshotDtype::kBank:
      return body(snapshot_source<VEC, T, SnapshotDtype::kBank>(io, dm, link));
    case SnapshotDtype::kBf16:
      return body(snapshot_source<VEC, T, SnapshotDtype::kBf16>(io, dm, link));
    case SnapshotDtype::kFloat8:
      return body(snapshot_source<VEC, T, SnapshotDtype::kFloat8>(io, dm, link));
    default:
      return body(snapshot_source<VEC, T, SnapshotDtype::kInt4>(io, dm, link));
  }
}

// pick(kT) for the snapshot dtype `type` as a compile-time constant (std::integral_constant): the instance of a
// kernel compiled for it.
template <typename Pick>
auto by_snapshot_dtype(SnapshotDtype type, Pick pick) {
  using D = SnapshotDtype;
  switch (type) {
    case D::kBank:
      return pick(std::integral_constant<D, D::kBank>{});
    case D::kBf16:
      return pick(std::integral_constant<D, D::kBf16>{});
    case D::kFloat8:
      return pick(std::integral_constant<D, D::kFloat8>{});
    default:
      return pick(std::integral_constant<D, D::kInt4>{});
  }
}

// <source, vec> over a row of D columns by a warp (a source of walk_two_sources: RowSource, CodedRowSource; vec in
// memory), in warp_dot's order: each lane's partial sum over its columns in increasing order, then the xor tree.
template <int VEC, typename Src, typename V>
__device__ __forceinline__ float source_dot(const Src& src, const V* vec, int64_t D, int lane) {
  float s = 0.f;
  for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
    typename Src::ColsT x;
    src.load(d, x);
    float y[VEC];
    load_cols<VEC>(vec + d, y);
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += x[i] * y[i];
  }
  return warp_sum(s);
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
