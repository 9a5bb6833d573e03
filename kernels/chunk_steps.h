// The bank-dependent chunk steps (docs/MATH.md "The forward chunk step" and "Backward of a chunk"), plain C++ / CUDA
// on raw pointers: the interface of kernels/chunk_steps/ (cpu.cc; the CUDA loops forward_cuda.cu and backward_cuda.cu
// with the kernels in their headers). The extension modules give Python the workspace sizes below (ffi/targets.h).
//
// Layout (docs/DESIGN.md): per-token arrays are [V, NC, P, C, ...] (V independent problems, e.g. from vmap,
// NC chunks, P streams), the unit (v, c, p) at index (v*NC + c)*P + p; the bank is [V, P, K, D], the rows of
// stream (v, p) at (v*P + p)*K. A chunk step depends on the previous chunk through the bank only, so chunks run
// in order and the V*P streams of one chunk in parallel. Every bank row, gradient row and output cell has one
// writer, and each sum runs in a fixed order: results are bitwise reproducible (docs/MATH.md "Determinism").
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_H_
#define JAX_SDM_KERNELS_CHUNK_STEPS_H_

#include <cstdint>

#include "kernels/snapshot_codec.h"

struct CUstream_st;  // cudaStream_t, declared so that this header needs no CUDA include

namespace sdm {

struct StepDims {
  int64_t V, NC, P, C, W, R, K, D;
  // The forward's input bank: 0 when it holds a [K, D] block per stream ([V, P, K, D]); else its count of blocks
  // ([input_streams, K, D], input_streams dividing P), stream s reading block s % input_streams: one bank shared by
  // a batch's streams (B*H streams of H heads), read as it is instead of broadcast to every stream first.
  int64_t input_streams = 0;
  int64_t units() const { return V * NC * P; }
  int64_t streams() const { return V * P; }
  int64_t unit(int64_t stream, int64_t c) const { return ((stream / P) * NC + c) * P + stream % P; }
  // The snapshot keeps the write groups of every chunk but the last: no later chunk reads a row through the last
  // one's, so it has [V, NC - 1, P] units of C * W entries, and unit u's group g (u of a chunk before the last) is
  // entry snapshot_entry(u, g).
  int64_t snapshot_chunks() const { return NC > 1 ? NC - 1 : 0; }
  SDM_HOST_DEVICE int64_t snapshot_entry(int64_t u, int64_t g) const { return (u - u / (NC * P) * P) * C * W + g; }
  bool stores_snapshot(int64_t c) const { return c + 1 < NC; }  // whether chunk c's writes go to the snapshot
  // The block of the input bank that stream s reads.
  SDM_HOST_DEVICE int64_t input_stream(int64_t s) const { return input_streams ? s % input_streams : s; }
  // The same dims for a bank of every stream (the backward's gradient banks: only the forward's input is shared).
  StepDims per_stream() const {
    StepDims d = *this;
    d.input_streams = 0;
    return d;
  }
};

// Phase-1 arrays the steps read (DESIGN.md "Phase 1"), and the solve's Minv.
struct StepPhase1 {
  const int32_t* k_idx;    // [.., C, W]
  const int32_t* q_idx;    // [.., C, R]
  const float* k_eff;      // [.., C, W]
  const float* w;          // [.., C, W]
  const float* cpe;        // [.., C, W]
  const float* q_w;        // [.., C, R]
  const float* A;          // [.., C, C]
  const float* QK;         // [.., C, C]
  const int32_t* w_order;  // [.., C*W]
  const int32_t* w_group;  // [.., C*W + 1]
  const int32_t* r_order;  // [.., C*R]
  const int32_t* r_group;  // [.., C*R + 1]
  const float* minv;       // [.., C, C]
};

struct ForwardIO {
  const void* v;      // [.., C, D] the bank's dtype (the op takes the values in it: widened on load)
  const float* beta;  // [.., C]
  void* y;            // [.., C, D] out, the bank's dtype (the readings leave the op in it: rounded once on store)
  // Residuals for the backward; all null for a no-grad forward.
  float* delta;    // [.., C, D] the write vectors
  float* vg;       // [.., C, D] v - G, G the gathers sum_n k_eff S0[s] (the backward's only use of v and G)
  void* snapshot;  // [.., C*W, row bytes] the written row of each stored write group (after the chunk's write;
  // StepDims::snapshot_entry, chunks but the last), stored as snapshot_dtype says (kernels/snapshot_codec.h: rows
  // of snapshot_row_bytes; kBank: [.., C*W, D] of the bank's dtype)
  SnapshotDtype snapshot_dtype = SnapshotDtype::kBank;
  float* snapshot_scale = nullptr;  // [.., C*W] each stored row's scale (kFloat8, kInt4; else null)
  // The links: for each write entry ([.., C, W]) and read entry ([.., C, R]), the snapshot entry of the latest
  // write of its slot that an earlier chunk of its stream stored, or -1 where none did (the row as the chunk starts
  // is then the input bank's). With them the backward reads every row as it was before a chunk from the snapshot
  // or the input bank: it needs no working bank (docs/DESIGN.md "Backward steps").
  int32_t* link_k = nullptr;
  int32_t* link_q = nullptr;
};

struct BackwardIO {
  const float* beta;      // [.., C]
  const void* dy;         // [.., C, D] the bank's dtype (the readings leave the op in it, so it holds their
                          // cotangent exactly at half the bytes of float32 for a bfloat16 bank)
  const float* delta;     // residuals of the forward
  const float* vg;
  const void* snapshot;
  float* dk_eff;          // [.., C, W]
  float* dw;              // [.., C, W]
  float* dcpe;            // [.., C, W] cotangent of cpe: <dS1[s], S0[s]> at each group's first sorted entry, 0 elsewhere
  float* dq_w;            // [.., C, R]
  float* dA;              // [.., C, C]
  float* dQK;             // [.., C, C]
  float* dbeta;           // [.., C]
  void* dv;               // [.., C, D] out, the bank's dtype (v's: rounded once on store)
  SnapshotDtype snapshot_dtype = SnapshotDtype::kBank;  // as the forward stored the snapshot (ForwardIO)
  const float* snapshot_scale = nullptr;
  const int32_t* link_k = nullptr;  // the forward's links (ForwardIO)
  const int32_t* link_q = nullptr;
};

// Packed sequences (docs/DESIGN.md "Packed sequences"): several segments per stream, each starting from the
// initial bank. Every bank row carries a stamp, the segment of its last write; a token reads a row from the
// working bank if the row's stamp is the token's segment and the token continues the segment running at its
// chunk's start, else from the initial bank. A chunk stores only the write groups of its last segment (the
// earlier ones are over). Phase 1 ran on virtual slots (one per slot and segment of the chunk), so no group
// and no pair of A or QK joins two segments. The steps take a null StepSegments* without packed sequences.
struct StepSegments {
  const int32_t* local;     // [.., C] each token's segment counted from the chunk's first (0: it continues it)
  const int32_t* seg0;      // [..] (one per unit) the segment running at the chunk's start
  const void* initial;      // [V, P, K, D] the bank's dtype: the initial bank, read for stale rows
  int32_t* stamp;           // [V, P, K]: forward out (from 0), backward in/out (from the final stamps back to 0)
  int32_t* stamp_snapshot;  // [.., C*W] the previous stamp of each stored write group (forward: null if no-grad)
  void* dinitial;           // backward only, [V, P, K, D] GradT: the gradient of the initial bank (in/out; the
                            // gradient of the stale reads and of the writes over stale rows is added to it)
};

// Forward chunk loop: bank (in/out, [V, P, K, D]) goes from the initial to the final bank (with segments: the
// working bank, each row that of its stamp's segment). BankT is float or sdm::bf16.
template <typename BankT>
void forward_cpu(const StepDims& dims, const StepPhase1& p1, const ForwardIO& io, BankT* bank,
                 const StepSegments* segments = nullptr);

// Backward chunk loop, chunks in reverse: bank_in is the forward's input bank (read only; [V, P, K, D], or shared
// as the forward's, StepDims::input_streams), each row as it was before a chunk read from the snapshot through
// the links, or from bank_in; dbank ([V, P, K, D], in/out) goes from the gradient of the final bank to that of the
// initial bank. GradT, the working gradient bank's type, is float, or bf16 for a bf16 bank (rows read into float32
// and rounded once where a step writes them). With segments the stamps are restored too and the gradient of the
// rows read from the initial bank goes to segments->dinitial.
template <typename BankT, typename GradT>
void backward_cpu(const StepDims& dims, const StepPhase1& p1, const BackwardIO& io, const BankT* bank_in,
                  GradT* dbank, const StepSegments* segments = nullptr);

// Whether the CUDA loops launch their kernels with programmatic dependent launch (on compute capability 9.0 and
// later): the build's SDM_CUDA_PDL (CMake option, ON by default). The results are the same either way.
// compute-sanitizer's racecheck and synccheck crash on such launches; a build with SDM_CUDA_PDL=OFF serves them
// (scripts/gpu_check.sh sanitize).
#ifndef SDM_CUDA_PDL
#define SDM_CUDA_PDL 1
#endif
constexpr bool kChunkStepsPdl = SDM_CUDA_PDL != 0;

// CUDA: the same loops, enqueued on `stream` (no allocation, no synchronisation; the launch configuration
// depends on the shapes only). `workspace` holds forward_workspace_floats(dims) / backward_workspace_floats(dims)
// floats (the handlers of both platforms take it, so that their interfaces are the same): first three per-chunk
// rows [streams, C, D] of float32 (step_rows_floats: per problem of the V, rounded up to 16 bytes), then a table of
// 16-byte entries, one per slot group (C * W write groups per stream and chunk: the forward's for all NC chunks; the
// backward's, then its C * R read groups, for table_chunks chunks: a ring rebuilt per batch of chunks), then each
// slot's first writing step ([streams, K] uint32) and the row tags of the gather lanes ([units, C, W] int32, and the
// forward's also [units, C, R]; see "fresh result" below), then the forward's latest write of each slot ([streams,
// K] int32: the links' table) and the backward's row of D zeros (16-byte aligned), then the backward's du ring
// (backward_du_ring_at) and last its dbeta shares (backward_dbeta_parts_at). BankT is float or __nv_bfloat16
// (passed as sdm::bf16, same layout). Returns the first cudaError_t met, 0 on success.
inline int64_t step_rows_floats(const StepDims& dims) { return dims.V * ((3 * dims.P * dims.C * dims.D + 3) / 4 * 4); }
// The backward's group tables hold ceil(NC / kTableBatches) chunks (0 for none): a quarter of the 2 * 16 MiB of
// tables for all chunks at the flagship (the workspace is live at the training step's memory peak), for at most
// kTableBatches - 1 more builds per call (each a memset, which the kernels' launch overlap cannot cross, and two
// table kernels over a batch's units).
constexpr int64_t kTableBatches = 4;
inline int64_t table_chunks(const StepDims& dims) { return (dims.NC + kTableBatches - 1) / kTableBatches; }
inline int64_t forward_workspace_floats(const StepDims& dims) {
  return step_rows_floats(dims) + 4 * dims.units() * dims.C * dims.W + 2 * dims.streams() * dims.K +
         dims.units() * dims.C * (dims.W + dims.R);
}
// The backward's du ring (BackRows::du): the batch of table_chunks chunks' du, [chunks, streams, C, D] float32,
// after everything else (16-byte aligned).
inline int64_t backward_du_ring_at(const StepDims& dims) {
  return (step_rows_floats(dims) + 4 * dims.streams() * table_chunks(dims) * dims.C * (dims.W + dims.R) +
          dims.streams() * dims.K + dims.units() * dims.C * dims.W + (dims.D + 3) / 4 * 4 + 4 + 3) / 4 * 4;
}
// The backward's dots (dA, dQK, dbeta) run by pairs of tiles of kDotsTile token rows; each pair's share of dbeta
// waits in [units, dots_tiles, C] float32 after the du ring (backward_dbeta_parts_at) until a row's shares are added.
constexpr int kDotsTile = 64;
SDM_HOST_DEVICE inline int64_t dots_tiles(const StepDims& dims) { return (dims.C + kDotsTile - 1) / kDotsTile; }
inline int64_t backward_dbeta_parts_at(const StepDims& dims) {
  return backward_du_ring_at(dims) + table_chunks(dims) * dims.streams() * dims.C * dims.D;
}
inline int64_t backward_workspace_floats(const StepDims& dims) {
  return backward_dbeta_parts_at(dims) + dims.units() * dots_tiles(dims) * dims.C;
}
// With `segments` (packed sequences, null without) the loops follow forward_cpu / backward_cpu's semantics; the
// stamps are zeroed by the forward (cudaMemsetAsync) and restored to zero by the backward.
// A fresh result: `bank_in` (the initial bank) and `bank` (the final one) of the forward, `dbank_in` (the final
// bank's cotangent) and `dbank` (the initial bank's gradient) of the backward may be one buffer (updated in place)
// or two. Given two, the loops without packed sequences copy no whole bank: a row is read from the input until the
// first step that writes it (into the result), and the rows no step writes are copied once. With packed sequences
// the input is first copied into the result. A null `dbank_in` is a zero cotangent: its rows read as zeros. The
// backward's `bank_in` is the forward's input bank, only read (as backward_cpu's).
// A no-grad forward in slabs of chunks (one call per slab, the bank carried from call to call) can be one fresh
// result over the whole sequence: every call gets the sequence's input bank as `bank_in` and the carried result as
// `bank`, and a SlabCarry. `first` ([V, P, K] uint32, carried with the bank) holds each slot's first writing step
// so far; the first slab fills it, each later one sees the slots the earlier ones wrote as written before its own
// steps. Rows are read from the input until their first write in any slab, and the rows no slab writes are copied
// once, by the last slab: the copy of a sequence's untouched rows is paid once, not per slab.
struct SlabCarry {
  uint32_t* first;
  bool first_slab;  // `first` is filled by this call (its contents are ignored)
  bool last_slab;   // this call copies the rows no slab wrote
};
template <typename BankT>
int forward_cuda(const StepDims& dims, const StepPhase1& p1, const ForwardIO& io, const BankT* bank_in, BankT* bank,
                 float* workspace, CUstream_st* stream, const StepSegments* segments = nullptr,
                 const SlabCarry* slab = nullptr);
template <typename BankT, typename GradT>
int backward_cuda(const StepDims& dims, const StepPhase1& p1, const BackwardIO& io, const BankT* bank_in,
                  const GradT* dbank_in, GradT* dbank, float* workspace, CUstream_st* stream,
                  const StepSegments* segments = nullptr);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_H_
