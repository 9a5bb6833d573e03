// The in-loop apply-inverse kernels (the forward's fwd_apply_inverse_kernel, the backward's bwd_apply_inverse_kernel;
// staged in shared memory) at each tile shape they compile to, 1, 2 and 4 rows a thread, at one chunk size and
// width: each shape's time per launch, and its outputs checked bit for bit against the one-row shape's (every output
// is one sum over k ascending whatever the tiling). dense_tile_rows (kernels/chunk_steps/dense.cuh) picks the shape
// the steps launch; this measures what the others would give, without rebuilding the package. Standalone, from the
// repository's root on the GPU machine:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. benchmarks/dense_tiles.cu -o /tmp/dense_tiles && /tmp/dense_tiles [P C D NC]
//
// (defaults: the paper's shape at chunk 128, P 2, C 128, D 2048, NC 16 chunks a round of launches). Times: CUDA
// events around 10 rounds of NC launches (chunk c = 0 .. NC-1, as the loop takes them) after a warm-up round, the
// median of 5 such runs. Inputs are random (a fixed seed); the values do not change the time. The outputs' digests
// compare builds: two versions of the kernels that must give the same bits print the same line. The instances on
// tensor cores (C a multiple of 16) give other bits: their lines show the largest difference from the one-row
// shape's outputs instead. Probes of the forward kernel's parts at the launched shape follow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/chunk_steps/backward_dense.cuh"
#include "kernels/chunk_steps/forward.cuh"
#include "kernels/chunk_steps/launch.cuh"

#include "cuda_check.h"

namespace {

using sdm::StepDims;
using T = __nv_bfloat16;

std::mt19937_64 rng(7);

// A device copy of host floats.
float* to_device(const std::vector<float>& host) {
  float* d = nullptr;
  CHECK(cudaMalloc(&d, host.size() * sizeof(float)));
  CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

// A device array of n floats, uniform in [lo, hi).
float* random_floats(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> host(n);
  for (auto& x : host) x = dist(rng);
  return to_device(host);
}

// n lower-triangular C x C matrices: random in [lo, hi) on and below the diagonal, zero above it (as the solve's
// Minv and Phase 1's QK are; the instances on tensor cores read the diagonal blocks whole).
float* random_lower(int64_t n, int64_t C, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> host(n * C * C);
  for (int64_t i = 0; i < n * C * C; ++i) host[i] = i % C <= i / C % C ? dist(rng) : 0.f;
  return to_device(host);
}

T* random_bf16(int64_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<T> host(n);
  for (auto& x : host) x = __float2bfloat16(dist(rng));
  T* d = nullptr;
  CHECK(cudaMalloc(&d, n * sizeof(T)));
  CHECK(cudaMemcpy(d, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// FNV-1a of bytes: one line that two builds' outputs can be compared by.
uint64_t fnv1a(const std::vector<char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (const char b : bytes) h = (h ^ static_cast<unsigned char>(b)) * 1099511628211ull;
  return h;
}

std::vector<char> bytes_of(const void* d, size_t n) {
  std::vector<char> host(n);
  CHECK(cudaMemcpy(host.data(), d, n, cudaMemcpyDeviceToHost));
  return host;
}

// Output bytes as floats: float32, or bfloat16 widened.
std::vector<float> f32_values(const std::vector<char>& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}
std::vector<float> bf16_values(const std::vector<char>& bytes) {
  std::vector<float> v(bytes.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    std::memcpy(&v[i], &w, sizeof(float));
  }
  return v;
}

// max |a - b| / max |b| (infinite when a holds a NaN or an infinity, as a poisoned output left unwritten does).
float max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float diff = 0.f, scale = 0.f;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return diff / scale;
}

// Median over 5 runs of the time per launch of `round` (NC launches), in microseconds.
template <typename Round>
float time_rounds(int64_t NC, Round round) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  round();
  std::vector<float> us;
  for (int run = 0; run < 5; ++run) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 10; ++i) round();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1e3f / (10 * NC));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Probes of the forward kernel's halves at one tile shape, to see where its time goes: an empty launch of its grid,
// its staging alone (the same copies, waited on, no product) and its products alone (on shared memory each block
// fills itself, no global load), as the kernel runs them (delta = Minv u, a barrier, y = QK delta) and fused (y
// from a second matrix and u in the same pass: the two products independent, as they would be with QK Minv formed
// ahead of the loop).
__global__ void probe_empty(float* sink) {
  if (threadIdx.x == 0 && sink[0] == 1.f) sink[1] = 0.f;  // never true: a launch that does nothing
}

template <int kRows>
__global__ void probe_stage(StepDims dm, sdm::StepPhase1 p1, sdm::ForwardIO io, int64_t c, sdm::ChunkRows rows,
                            float* sink) {
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = sdm::tile_rows(C) * sdm::kSlice, ms = sdm::matrix_stride(C);
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * sdm::kSlice, u = sdm::unit_of(dm, s, c);
  float* smi = sh + 4 * slice;
  sdm::stage_matrix_async(p1.minv + u * C * C, C, smi);
  sdm::stage_matrix_async(p1.QK + u * C * C, C, smi + sdm::tile_rows(C) * ms);
  sdm::stage_slice(static_cast<const T*>(io.v) + u * C * dm.D, C, dm.D, d0, sh);
  sdm::stage_slice_async(rows.G + rows.at(dm, u, s), C, dm.D, d0, sh + 2 * slice);
  sdm::stage_slice_async(rows.Q0 + s * C * dm.D, C, dm.D, d0, sh + 3 * slice);
  sdm::staged_wait();
  if (threadIdx.x == 0) sink[blockIdx.x * gridDim.y + blockIdx.y] = sh[blockIdx.y % slice] + smi[0];
}

template <int kRows, bool kFused>
__global__ void probe_products(StepDims dm, int64_t c, sdm::ChunkRows rows, T* y) {
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = sdm::tile_rows(C) * sdm::kSlice, ms = sdm::matrix_stride(C);
  const int64_t D = dm.D, s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * sdm::kSlice;
  const int64_t u = sdm::unit_of(dm, s, c);
  float* su = sh;
  float* sdelta = su + slice;
  float* smi = sh + 4 * slice;
  float* sqk = smi + sdm::tile_rows(C) * ms;
  // Cheap fills (no division), so that the probe's time is the products'.
  for (int i = threadIdx.x; i < slice; i += blockDim.x) su[i] = 1.f - 1e-3f * (i & 127);
  for (int i = threadIdx.x; i < 2 * sdm::tile_rows(C) * ms; i += blockDim.x) smi[i] = 1e-3f * (i & 63);
  __syncthreads();
  float* delta = rows.delta + rows.at(dm, u, s);
  T* yu = y + u * C * D;
  if constexpr (kFused) {
    sdm::for_tiles<kRows>(C, [&](int r0, int q) {
      float4 x[kRows], z[kRows];
      sdm::tri_tile<false, true, kRows>(smi, ms, su, r0, q, C, x);
      sdm::tri_tile<false, true, kRows>(sqk, ms, su, r0, q, C, z);
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (r0 + j >= C) break;
        sdm::store_quad(delta + (r0 + j) * D, d0 + 4 * q, D, x[j]);
        sdm::store_quad(yu + (r0 + j) * D, d0 + 4 * q, D, z[j]);
      }
    });
    return;
  }
  sdm::for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    sdm::tri_tile<false, true, kRows>(smi, ms, su, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (r0 + j >= C) break;
      reinterpret_cast<float4*>(sdelta + (r0 + j) * sdm::kSlice)[q] = x[j];
      sdm::store_quad(delta + (r0 + j) * D, d0 + 4 * q, D, x[j]);
    }
  });
  __syncthreads();
  sdm::for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    sdm::tri_tile<false, true, kRows>(sqk, ms, sdelta, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (r0 + j < C) sdm::store_quad(yu + (r0 + j) * D, d0 + 4 * q, D, x[j]);
  });
}

}  // namespace

int main(int argc, char** argv) {
  StepDims dm{};
  dm.V = 1;
  dm.P = argc > 1 ? std::atoll(argv[1]) : 2;
  dm.C = argc > 2 ? std::atoll(argv[2]) : 128;
  dm.D = argc > 3 ? std::atoll(argv[3]) : 2048;
  dm.NC = argc > 4 ? std::atoll(argv[4]) : 16;
  dm.W = dm.R = 1;
  dm.K = 1;
  if (dm.C > sdm::kStagedLoopMaxC || !sdm::dense_staged(dm.C, sdm::kStagedLoopMaxC, sdm::kFwdApplySmem)) {
    std::fprintf(stderr, "C %lld is not staged on this device\n", static_cast<long long>(dm.C));
    return 2;
  }
  const int64_t C = dm.C, D = dm.D, units = dm.units(), streams = dm.streams();
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; P %lld, C %lld, D %lld, %lld chunks a round\n", prop.name, prop.multiProcessorCount,
              static_cast<long long>(dm.P), static_cast<long long>(C), static_cast<long long>(D),
              static_cast<long long>(dm.NC));

  // The solve's Minv and QK: lower triangular, scaled so that the products stay near 1.
  sdm::StepPhase1 p1{};
  float* minv = random_lower(units, C, -1.f / C, 1.f / C);
  float* qk = random_lower(units, C, -1.f / C, 1.f / C);
  p1.minv = minv;
  p1.QK = qk;
  sdm::ForwardIO io{};
  io.v = random_bf16(units * C * D);
  io.beta = random_floats(units * C, 0.f, 1.f);
  T* y = nullptr;
  CHECK(cudaMalloc(&y, units * C * D * sizeof(T)));
  io.y = y;
  float* G = random_floats(streams * C * D, -1.f, 1.f);
  float* Q0 = random_floats(streams * C * D, -1.f, 1.f);
  float* delta = nullptr;
  CHECK(cudaMalloc(&delta, streams * C * D * sizeof(float)));
  const sdm::ChunkRows rows{G, Q0, delta, false};  // the no-grad loop's scratch layout: G and Q0 stay as they are

  sdm::BackwardIO bio{};
  bio.beta = io.beta;
  float* du0 = random_floats(streams * C * D, -1.f, 1.f);
  float* du = nullptr;
  float* dG = nullptr;
  CHECK(cudaMalloc(&du, streams * C * D * sizeof(float)));
  CHECK(cudaMalloc(&dG, streams * C * D * sizeof(float)));
  const sdm::BackRows brows{random_floats(streams * C * D, -1.f, 1.f), dG, du, nullptr};

  const dim3 grid(streams, (D + sdm::kSlice - 1) / sdm::kSlice);
  const size_t fwd_smem = sdm::kFwdApplySmem.bytes(C, true), bwd_smem = sdm::kBwdApplySmem.bytes(C, true);
  const int chosen = sdm::dense_tile_rows(C, true, true);
  std::vector<char> ref_y, ref_delta, ref_du, ref_dG;
  std::printf("\n| kernel | rows a thread | threads | us a launch | bits as 1 row |\n|---|---:|---:|---:|---|\n");
  // One tile shape: the bits of one round compared with the one-row shape's (the first run), then its time. The
  // instances on tensor cores (kMmaRows) give other bits: their largest difference instead, not counted as a change.
  const auto run = [&](auto rows_c) {
    constexpr int kRows = decltype(rows_c)::value;
    const auto fwd = sdm::fwd_apply_inverse_kernel<T, true, kRows>;
    const auto bwd = sdm::bwd_apply_inverse_kernel<true, kRows>;
    const int threads = sdm::tile_threads(C, kRows), ss = sdm::slice_stride(kRows);
    const size_t f_smem = sdm::kFwdApplySmem.bytes(C, true, ss), b_smem = sdm::kBwdApplySmem.bytes(C, true, ss);
    CHECK(cudaFuncSetAttribute(fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(f_smem)));
    CHECK(cudaFuncSetAttribute(bwd, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(b_smem)));
    const auto fwd_round = [&] {
      for (int64_t c = 0; c < dm.NC; ++c) fwd<<<grid, threads, f_smem>>>(dm, p1, io, c, rows);
    };
    const auto bwd_round = [&] {
      for (int64_t c = 0; c < dm.NC; ++c) bwd<<<grid, threads, b_smem>>>(dm, p1, bio, c, brows);
    };
    // One round on poisoned outputs (du from the same start for every shape), its bits kept or compared.
    CHECK(cudaMemset(y, 0xff, units * C * D * sizeof(T)));
    CHECK(cudaMemset(delta, 0xff, streams * C * D * sizeof(float)));
    CHECK(cudaMemset(dG, 0xff, streams * C * D * sizeof(float)));
    CHECK(cudaMemcpy(du, du0, streams * C * D * sizeof(float), cudaMemcpyDeviceToDevice));
    fwd_round();
    bwd_round();
    CHECK(cudaDeviceSynchronize());
    const auto out_y = bytes_of(y, units * C * D * sizeof(T)), out_delta = bytes_of(delta, streams * C * D * 4),
               out_du = bytes_of(du, streams * C * D * 4), out_dG = bytes_of(dG, streams * C * D * 4);
    if (ref_y.empty()) ref_y = out_y, ref_delta = out_delta, ref_du = out_du, ref_dG = out_dG;
    const float f_us = time_rounds(dm.NC, fwd_round), b_us = time_rounds(dm.NC, bwd_round);
    if constexpr (kRows == sdm::kMmaRows) {
      const auto f32 = [](const std::vector<char>& a, const std::vector<char>& b) {
        return max_rel_diff(f32_values(a), f32_values(b));
      };
      const float e_y = max_rel_diff(bf16_values(out_y), bf16_values(ref_y));
      std::printf("| fwd_apply_inverse | tensor cores (3xTF32) | %d | %.2f | largest difference over the largest "
                  "output: delta %.1e, y %.1e |\n", threads, f_us, f32(out_delta, ref_delta), e_y);
      std::printf("| bwd_apply_inverse | tensor cores (3xTF32) | %d | %.2f | largest difference over the largest "
                  "output: du %.1e, dG %.1e |\n", threads, b_us, f32(out_du, ref_du), f32(out_dG, ref_dG));
      return true;
    }
    const bool fwd_same = out_y == ref_y && out_delta == ref_delta, bwd_same = out_du == ref_du && out_dG == ref_dG;
    const char* mark = kRows == chosen ? " (launched)" : "";
    std::printf("| fwd_apply_inverse | %d%s | %d | %.2f | %s |\n", kRows, mark, threads, f_us,
                fwd_same ? "same" : "DIFFERENT");
    std::printf("| bwd_apply_inverse | %d%s | %d | %.2f | %s |\n", kRows, mark, threads, b_us,
                bwd_same ? "same" : "DIFFERENT");
    return fwd_same && bwd_same;
  };
  bool same = run(std::integral_constant<int, 1>{});
  same = run(std::integral_constant<int, 2>{}) && same;
  same = run(std::integral_constant<int, 4>{}) && same;
  if (C % sdm::kMmaRows == 0) run(std::integral_constant<int, sdm::kMmaRows>{});
  std::printf("\noutput digests (FNV-1a): y %016llx delta %016llx du %016llx dG %016llx\n",
              static_cast<unsigned long long>(fnv1a(ref_y)), static_cast<unsigned long long>(fnv1a(ref_delta)),
              static_cast<unsigned long long>(fnv1a(ref_du)), static_cast<unsigned long long>(fnv1a(ref_dG)));

  // The probes at the launched tile shape: no bits to compare (their inputs are their own).
  const auto probes = [&](auto rows_c) {
    constexpr int kRows = decltype(rows_c)::value;
    const int threads = sdm::tile_threads(C, kRows);
    float* sink = nullptr;
    CHECK(cudaMalloc(&sink, grid.x * grid.y * sizeof(float)));
    const auto stage = probe_stage<kRows>;
    const auto serial = probe_products<kRows, false>;
    const auto fused = probe_products<kRows, true>;
    CHECK(cudaMemset(sink, 0, grid.x * grid.y * sizeof(float)));
    for (const void* f : {reinterpret_cast<const void*>(probe_empty), reinterpret_cast<const void*>(stage),
                          reinterpret_cast<const void*>(serial), reinterpret_cast<const void*>(fused)})
      CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(fwd_smem)));
    std::printf("\n| probe (fwd, %d rows a thread) | us a launch |\n|---|---:|\n", kRows);
    std::printf("| an empty launch, the same grid, threads and shared memory | %.2f |\n", time_rounds(dm.NC, [&] {
      for (int64_t c = 0; c < dm.NC; ++c) probe_empty<<<grid, threads, fwd_smem>>>(sink);
    }));
    std::printf("| staging alone | %.2f |\n", time_rounds(dm.NC, [&] {
      for (int64_t c = 0; c < dm.NC; ++c) stage<<<grid, threads, fwd_smem>>>(dm, p1, io, c, rows, sink);
    }));
    std::printf("| products alone, as launched | %.2f |\n", time_rounds(dm.NC, [&] {
      for (int64_t c = 0; c < dm.NC; ++c) serial<<<grid, threads, fwd_smem>>>(dm, c, rows, y);
    }));
    std::printf("| products alone, fused | %.2f |\n", time_rounds(dm.NC, [&] {
      for (int64_t c = 0; c < dm.NC; ++c) fused<<<grid, threads, fwd_smem>>>(dm, c, rows, y);
    }));
    CHECK(cudaFree(sink));
  };
  probes(std::integral_constant<int, sdm::kLoopTileRows>{});
  return same ? 0 : 1;
}
