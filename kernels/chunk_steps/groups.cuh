// Slot groups as the group kernels take them (docs/MATH.md "Phase 1": a group is the run of sorted entries of one
// slot, and one warp owns the group's bank row): the group tables built before the chunks that read them, a warp's
// group, the groups one warp of a token's block takes in turn (the unpacked kernels), and the sum over a group's
// entries.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_GROUPS_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_GROUPS_CUH_

#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/fresh.cuh"

namespace sdm {
namespace {

constexpr int kGroupWarps = 8;      // warps (= groups) per block of the group kernels
constexpr int kGroupBlocksPerSM = 2;  // register budget of the group kernels: 2 blocks per SM (128 registers)

constexpr int kOwnerWarps = 8;      // warps per block of the unpacked group kernels (blocks per stream and token)
constexpr int kOwnerBlocksPerSM = 2;  // their register budget: 2 blocks of 256 threads per SM (128 registers)
constexpr int kOwnerSplitMax = 4;   // the most blocks a token's lanes are split over (owner_split)
constexpr int64_t kOwnerStageFloats = 8192;  // a block stages its token's vectors in shared memory up to this size


// One slot group of a chunk (DESIGN.md "Phase 1": a run of sorted entries [lo, hi) with one slot): its slot
// (-1 when the warp has nothing to do: an empty group, padding, an out-of-range slot), its entries and the first
// of them in sorted order. A table of these for every unit and group is built before the chunks that read it
// (group_table_kernel; the backward's per batch of chunks: table_unit) so that a group kernel's warp finds its row
// with one 16-byte load instead of a chain of three dependent ones (group offsets, then the sorted order, then the
// slot id) before its first row load can issue.
struct alignas(16) GroupEntry {
  int32_t slot, lo, hi, first;
};

// A map's group table holds the groups of `chunks` chunks: the forward's all NC, built before its loop; the
// backward's a ring of table_chunks (kernels/chunk_steps.h), rebuilt per batch of that many chunks as its reverse loop
// reaches them (backward_loop). Chunk c is at ring place c % chunks, stream s's n = C * lanes entries at table unit
// table_unit(s, c) = table_unit(0, c) + s. A kernel of chunk c takes the tables from its place on (ChunkTables::at),
// so that its readers find stream s's entries at s * n, with no ring arithmetic of their own.
__host__ __device__ inline int64_t table_unit(const StepDims& dm, int64_t chunks, int64_t s, int64_t c) {
  return c % chunks * (dm.V * dm.P) + s;
}

// The table of a map of DESIGN.md (w_* with k_idx, or r_* with q_idx; `lanes` its W or R; holding `chunks` chunks)
// for chunks [c0, c1) of every stream s, n = C * lanes entries per unit u at out = table + table_unit(s, c) * n: by
// group, out[g] = {slot, lo, hi, first} for every group g < n (the packed kernels); or by first entry (the unpacked
// kernels), out[first] = {slot, lo, hi, g} at the first sorted entry of every group with a slot in range, the rest
// left as they are (filled with -1 before). With `first` (a fresh result's first steps; by first entry) `hi`
// carries kFromInput when the group's kernel, at `step`, reads its row from the input. With `links` (the backward's,
// by first entry) the last field is the link of the group's first entry instead of g (ForwardIO::link_k,
// link_q: where the group's S0 is). Nothing is written before chain_start (backward_loop's ring relies on it).
__global__ void group_table_kernel(StepDims dm, const int32_t* __restrict__ order, const int32_t* __restrict__ group,
                                   const int32_t* __restrict__ idx, int64_t lanes, int64_t chunks, int64_t c0,
                                   int64_t c1, bool by_first, const uint32_t* __restrict__ first,
                                   const int32_t* __restrict__ links, StepOf step, GroupEntry* __restrict__ table) {
  chain_start();
  const int64_t n = dm.C * lanes, streams = dm.V * dm.P;
  for (int64_t b = blockIdx.y; b < streams * (c1 - c0); b += gridDim.y) {
    const int64_t s = b % streams, c = c0 + b / streams, u = unit_of(dm, s, c);
    GroupEntry* out = table + table_unit(dm, chunks, s, c) * n;
    const int32_t* bounds = group + u * (n + 1);
    const uint32_t* f = first ? first + s * dm.K : nullptr;
    const uint32_t at = step(dm, u);
    for (int64_t g = entry_start(); g < n; g += entry_stride()) {
      GroupEntry e{-1, bounds[g], bounds[g + 1], -1};
      if (e.lo < e.hi) {
        const int32_t head = order[u * n + e.lo];
        const int32_t slot = head >= 0 ? idx[u * n + head] : -1;
        if (slot >= 0 && slot < dm.K) {
          e.slot = slot;
          e.first = head;
        }
      }
      if (!by_first) {
        out[g] = e;
      } else if (e.slot >= 0) {
        const bool from_input = f && f[e.slot] >= at;
        out[e.first] = GroupEntry{e.slot, e.lo, e.hi | (from_input ? kFromInput : 0),
                                  links ? links[u * n + e.first] : static_cast<int32_t>(g)};
      }
    }
  }
}

// The slot group of this warp (one warp per group; blockIdx.x the stream, blockIdx.y * kGroupWarps + warp the
// group) in chunk c: its unit u, its sorted entries [lo, hi), the first of them and its slot, from chunk c's
// group table of a map with `lanes` lanes (W or R). False when the warp has no group.
struct Group {
  int64_t s, u, g;  // g: the group; from the backward's tables by first entry, the link of its first entry
  int lane;
  int32_t lo, hi, slot, first;
  bool from_input;  // a fresh output bank's first write of the slot: the row is the input bank's
};

__device__ __forceinline__ bool warp_group(const StepDims& dm, int64_t c, const GroupEntry* table, int64_t lanes,
                                           Group* out) {
  const int64_t n = dm.C * lanes;
  out->s = blockIdx.x;
  out->g = static_cast<int64_t>(blockIdx.y) * kGroupWarps + threadIdx.x / 32;
  out->lane = threadIdx.x % 32;
  if (out->g >= n) return false;
  out->u = unit_of(dm, out->s, c);
  const int4 e = __ldg(reinterpret_cast<const int4*>(table + out->s * n + out->g));
  out->slot = e.x;
  out->lo = e.y;
  out->hi = e.z;
  out->first = e.w;
  out->from_input = false;
  return out->slot >= 0;
}

// The group tables of a kernel's chunk (ChunkTables::at): write groups, and read groups (backward); stream s's
// C * W or C * R entries at s * C * W or s * C * R.
struct GroupTables {
  const GroupEntry* w;
  const GroupEntry* r;
};

// The unpacked group kernels take each slot group at its first sorted entry (the table by first entry): owner_split
// blocks per (stream s, token t of unit u), whose warps take the token's entries in turn, each the group it heads,
// if any.
// Most groups have one entry, so the float32 vectors a group reads (delta; delta and dG; dy) are the token's: the
// block stages them in shared memory (stage_token) instead of each warp reading them from L2, and the registers
// that held them keep more bank rows in flight.

// The most blocks a token's `lanes` can be split over (blockIdx.z; at least two entries a warp). Whether they are
// split depends on the grid (owner_launch): one block a token can leave a grid of about one wave (2 streams x 128
// tokens), whose SMs idle a fifth of the kernel while its slowest blocks finish; blocks of a quarter of the lanes
// fill the SMs in several waves. A grid of two waves or more gains nothing from the split and loses its blocks'
// fixed start (the token's vectors staged once a block).
__host__ __device__ constexpr int owner_split(int64_t lanes) {
  return lanes >= 2 * kOwnerWarps * kOwnerSplitMax ? kOwnerSplitMax
         : lanes >= 4 * kOwnerWarps                 ? static_cast<int>(lanes / (2 * kOwnerWarps))
                                                    : 1;
}

// Floats per staged vector: D rounded up to whole quads (16-byte aligned rows; a partial quad's zeros stay inside).
__host__ __device__ constexpr int64_t owner_stride(int64_t D) { return (D + 3) / 4 * 4; }

// Row t = blockIdx.y of each of the NV vectors `vecs` into shared memory `staged` when NV * D <= kOwnerStageFloats
// (else pre points at them in global memory); pre[i] is where row t of vecs[i] is read. Ends with a block barrier.
template <int NV>
__device__ __forceinline__ void stage_token(int64_t D, const float* const (&vecs)[NV], float* staged,
                                            const float* (&pre)[NV]) {
  const int64_t t = blockIdx.y, stride = owner_stride(D);
  const bool stage = NV * stride <= kOwnerStageFloats;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    pre[i] = vecs[i] + t * D;
    if (!stage) continue;
    for (int64_t d = 4 * static_cast<int64_t>(threadIdx.x); d < D; d += 4 * static_cast<int64_t>(blockDim.x))
      copy_quad_async(staged + i * stride + d, pre[i] + d, static_cast<int>(D - d < 4 ? D - d : 4), D % 4 == 0);
    pre[i] = staged + i * stride;
  }
  if (stage) staged_wait();
}

// The groups one warp takes: the entries w = base + j + k * J (k < 32) of the block's token, where the token's
// blocks' J = gridDim.z * kOwnerWarps warps are j = blockIdx.z * kOwnerWarps + warp, lane k holding entry k's table
// row, loaded up front in one round (not one dependent load per group); next() hands out the groups these entries
// head, in increasing w, through shuffles. Warp-uniform.
struct OwnedGroups {
  const GroupEntry* mine;  // the token's table rows
  int64_t lanes, t;
  int64_t base = 0;
  int4 e;
  unsigned todo;
  Group gr;
  __device__ __forceinline__ OwnedGroups(const StepDims& dm, int64_t s, int64_t u, const GroupEntry* table,
                                         int64_t lanes_)
      : mine(table + (s * dm.C + blockIdx.y) * lanes_), lanes(lanes_), t(blockIdx.y) {
    gr.s = s;
    gr.u = u;
    gr.lane = threadIdx.x % 32;
    load_round();
  }
  static __device__ __forceinline__ int64_t warps() { return static_cast<int64_t>(gridDim.z) * kOwnerWarps; }
  __device__ __forceinline__ int64_t entry(int k) const {
    return base + static_cast<int64_t>(blockIdx.z) * kOwnerWarps + threadIdx.x / 32 + k * warps();
  }
  __device__ __forceinline__ void load_round() {
    const int64_t w = entry(gr.lane);
    e = w < lanes ? __ldg(reinterpret_cast<const int4*>(mine + w)) : make_int4(-1, -1, -1, -1);
    todo = __ballot_sync(0xffffffffu, e.x >= 0);
  }
  __device__ __forceinline__ bool next() {
    while (todo == 0) {
      base += 32 * warps();
      if (base >= lanes) return false;
      load_round();
    }
    const int k = __ffs(todo) - 1;
    todo &= todo - 1;
    gr.slot = __shfl_sync(0xffffffffu, e.x, k);
    gr.lo = __shfl_sync(0xffffffffu, e.y, k);
    const int32_t hi = __shfl_sync(0xffffffffu, e.z, k);
    gr.hi = hi & ~kFromInput;
    gr.from_input = (hi & kFromInput) != 0;
    gr.g = __shfl_sync(0xffffffffu, e.w, k);
    gr.first = static_cast<int32_t>(t * lanes + entry(k));
    return true;
  }
};

// body(group, vectors) for every group the warp takes, the token's vectors staged first. Vectors in the bank's
// dtype (V, the read side's dy) are widened to float32 on their way into shared memory (cp.async copies bytes as
// they are); too long to stage, body gets them where they are, in their dtype (`pre` then has another type).
template <int NV, typename V, typename Body>
__device__ __forceinline__ void for_owned_groups(const StepDims& dm, int64_t s, int64_t u, const GroupEntry* table,
                                                 int64_t lanes, const V* const (&vecs)[NV], float* staged,
                                                 Body body) {
  OwnedGroups owned(dm, s, u, table, lanes);
  if constexpr (std::is_same_v<V, float>) {
    const float* pre[NV];
    stage_token(dm.D, vecs, staged, pre);
    while (owned.next()) body(owned.gr, pre);
  } else {
    const int64_t D = dm.D, t = blockIdx.y, stride = owner_stride(D);
    if (NV * stride > kOwnerStageFloats) {
      const V* pre[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) pre[i] = vecs[i] + t * D;
      while (owned.next()) body(owned.gr, pre);
      return;
    }
    const float* pre[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      for (int64_t d = 4 * static_cast<int64_t>(threadIdx.x); d < D; d += 4 * static_cast<int64_t>(blockDim.x))
        *reinterpret_cast<float4*>(staged + i * stride + d) = load_quad(vecs[i] + t * D, d, D);
      pre[i] = staged + i * stride;
    }
    __syncthreads();
    while (owned.next()) body(owned.gr, pre);
  }
}

// acc += sum over the sorted entries e = order[from..hi) of coef[e] * vecs[e / W][0, VEC) (vecs: rows of D floats,
// offset to the columns of acc). With acc = scale * row first, the written row of the forward (cpe S0 + sum w
// delta; it adds the first entry itself, whose vector is its block's token's, and passes from = lo + 1) and Phase A's
// bank gradient of a long group (cpe dS1 + sum k_eff dG, from = lo) are this one sum.
template <int VEC, typename V>
__device__ __forceinline__ void group_add(const int32_t* order, int32_t from, int32_t hi, const float* coef,
                                          const V* vecs, int64_t W, int64_t D, float* acc) {
  for (int32_t k = from; k < hi; ++k) {
    const int32_t e = order[k];
    float x[VEC];
    load_cols_ro<VEC>(vecs + (e / W) * D, x);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += coef[e] * x[i];
  }
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_GROUPS_CUH_
