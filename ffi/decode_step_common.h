// Argument checks shared by the CPU and CUDA handlers `sdm_decode_step` (docs/DESIGN.md "Decode step"): a handler
// binds its buffers, calls PrepareDecodeStep, then calls its platform's kernel.
#ifndef JAX_SDM_FFI_DECODE_STEP_COMMON_H_
#define JAX_SDM_FFI_DECODE_STEP_COMMON_H_

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "ffi/product_key_topk_common.h"
#include "kernels/decode_step.h"

// The buffers of `sdm_decode_step`, in order (docs/DESIGN.md "Decode step"; ffi/common.h SDM_FFI_PARAMS), shared
// by the CPU and CUDA handlers; the bank arrives aliased to its result.
#define SDM_DECODE_BUFFERS(X, SEP)                                                                              \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, k_val) SEP() X(Arg, ::sdm_ffi::F32, x) SEP() X(Arg, ::sdm_ffi::AnyBuffer, v)     \
  SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Arg, ::sdm_ffi::S32, q_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, q_val) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP()                        \
  X(Ret, ::sdm_ffi::AnyBuffer, y)

// The buffers and attributes of `sdm_layer_decode_step` (kernels/decode_step.h "The layer's decode step"): the
// bank (aliased to its result), per stream the top lists' ids and scores [..., 2, k] (writes, then reads), the
// input projection's row [..., width], the heads' gate parameters [..., H, 2] and the readout norm's [..., 2, D]
// (leading dims of product G, dividing the streams' into G groups with the heads last); the
// lanes, the columns of v, b, a and the output gate's projection (og_offset < 0: none), the codes of the
// activations and of the norm; the results: the bank and the outputs [..., D], in the bank's dtype.
#define SDM_LAYER_DECODE_BUFFERS(X, SEP)                                                                        \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, ids) SEP() X(Arg, ::sdm_ffi::F32, scores)     \
  SEP() X(Arg, ::sdm_ffi::AnyBuffer, proj) SEP() X(Arg, ::sdm_ffi::F32, gates) SEP()                            \
  X(Arg, ::sdm_ffi::F32, norm) SEP() X(Attr, int64_t, num_writes) SEP() X(Attr, int64_t, num_reads) SEP()       \
  X(Attr, int64_t, v_offset) SEP() X(Attr, int64_t, b_offset) SEP() X(Attr, int64_t, a_offset) SEP()            \
  X(Attr, int64_t, og_offset) SEP() X(Attr, int64_t, write_activation) SEP()                                   \
  X(Attr, int64_t, read_activation) SEP() X(Attr, int64_t, per_write_gates) SEP()                               \
  X(Attr, int64_t, readout_norm) SEP() X(Attr, float, write_scale) SEP() X(Attr, float, read_scale) SEP()       \
  X(Attr, float, norm_eps) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP() X(Ret, ::sdm_ffi::AnyBuffer, out)

// `sdm_layer_decode_rank_step`: the same with the lists ranked in the call (kernels/decode_step.h): in place of
// ids and scores, the product-key top-k's candidate table [..., F, C] and the attributes `factors`, `k` and the
// address rows' columns `write_rank_offset`, `read_rank_offset`.
#define SDM_LAYER_DECODE_RANK_BUFFERS(X, SEP)                                                                   \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::AnyBuffer, proj) SEP()                             \
  X(Arg, ::sdm_ffi::S32, table) SEP() X(Arg, ::sdm_ffi::F32, gates) SEP() X(Arg, ::sdm_ffi::F32, norm) SEP()   \
  X(Attr, ::sdm_ffi::Factors, factors) SEP() X(Attr, int64_t, k) SEP() X(Attr, int64_t, write_rank_offset)     \
  SEP() X(Attr, int64_t, read_rank_offset) SEP() X(Attr, int64_t, num_writes) SEP()                             \
  X(Attr, int64_t, num_reads) SEP() X(Attr, int64_t, v_offset) SEP() X(Attr, int64_t, b_offset) SEP()          \
  X(Attr, int64_t, a_offset) SEP() X(Attr, int64_t, og_offset) SEP() X(Attr, int64_t, write_activation) SEP() \
  X(Attr, int64_t, read_activation) SEP() X(Attr, int64_t, per_write_gates) SEP()                               \
  X(Attr, int64_t, readout_norm) SEP() X(Attr, float, write_scale) SEP() X(Attr, float, read_scale) SEP()       \
  X(Attr, float, norm_eps) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP() X(Ret, ::sdm_ffi::AnyBuffer, out)

namespace sdm_ffi {

// A checked call, ready for a platform's kernel.
struct DecodeCall {
  sdm::DecodeDims dm;
  ffi::DataType type;  // the bank's (and the values') dtype
  const int32_t* k_idx;
  const void* k_val;
  const float* x;
  const void* v;
  const float* beta;
  const int32_t* q_idx;
  const void* q_val;
  void* y;
  const void* bank_in;
  void* bank;  // the result, aliased to bank_in unless XLA handed two buffers
  size_t bank_bytes;

  template <typename T>
  sdm::DecodeToken<T> token() const {
    return sdm::DecodeToken<T>{k_idx, static_cast<const T*>(k_val), x, static_cast<const T*>(v), beta, q_idx,
                               static_cast<const T*>(q_val), static_cast<T*>(y)};
  }
};

// Shapes: bank [S..., K, D], k_idx / k_val [S..., W], x [S...] or [S..., W], v [S..., D], beta [S...],
// q_idx / q_val [S..., R]; results bank [S..., K, D] and y [S..., D] in the bank's dtype. S... is any batch shape
// (the streams, and a leading axis per vmap).
inline ffi::Error PrepareDecodeStep(const char* op, SDM_FFI_PARAMS(SDM_DECODE_BUFFERS), DecodeCall* call) {
  auto bd = bank.dimensions();
  if (bd.size() < 2 || k_idx.dimensions().size() < 1 || q_idx.dimensions().size() < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": bank must be [..., K, D] and k_idx, q_idx [..., W|R]");
  const ffi::DataType type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  sdm::DecodeDims& dm = call->dm;
  dm.S = LeadingProduct(bd, 2);
  dm.K = bd[bd.size() - 2];
  dm.D = bd.back();
  dm.W = k_idx.dimensions().back();
  dm.R = q_idx.dimensions().back();
  dm.per_write_gates = x.dimensions().size() == k_idx.dimensions().size();
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_idx", k_idx, dm.S, {dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, dm.S, {dm.W}));
  if (dm.per_write_gates) {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x (per write)", x, dm.S, {dm.W}));
  } else {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x (per token)", x, dm.S, {}));
  }
  SDM_RETURN_IF_ERROR(CheckShape(op, "v", v, dm.S, {dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, dm.S, {}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, dm.S, {dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, dm.S, {dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, dm.S, {dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", *y, dm.S, {dm.D}));
  for (auto [name, a] : {std::pair<const char*, const ffi::AnyBuffer*>{"k_val", &k_val}, {"v", &v},
                         {"q_val", &q_val}, {"bank (result)", &*bank_out}, {"y (result)", &*y}}) {
    SDM_RETURN_IF_ERROR(CheckValueType(op, name, *a, type));
  }
  *call = DecodeCall{dm,
                     type,
                     k_idx.typed_data(),
                     k_val.untyped_data(),
                     x.typed_data(),
                     v.untyped_data(),
                     beta.typed_data(),
                     q_idx.typed_data(),
                     q_val.untyped_data(),
                     y->untyped_data(),
                     bank.untyped_data(),
                     bank_out->untyped_data(),
                     bank.size_bytes()};
  return ffi::Error::Success();
}

// A checked call of `sdm_layer_decode_step`.
struct LayerDecodeCall {
  sdm::LayerDecodeDims dm;
  sdm::LayerDecodeInputs in;
  const void* bank_in;
  void* bank;  // the result, aliased to bank_in unless XLA handed two buffers
  size_t bank_bytes;
};

// The checks both layer targets share: everything but the lists (k: their length).
inline ffi::Error PrepareLayerCommon(const char* op, const ffi::AnyBuffer& bank, int64_t k, const ffi::AnyBuffer& proj,
                                     const F32& gates, const F32& norm, int64_t num_writes, int64_t num_reads,
                                     int64_t v_offset, int64_t b_offset, int64_t a_offset, int64_t og_offset,
                                     int64_t write_activation, int64_t read_activation, int64_t per_write_gates,
                                     int64_t readout_norm, float write_scale, float read_scale, float norm_eps,
                                     ffi::Result<ffi::AnyBuffer>& bank_out, ffi::Result<ffi::AnyBuffer>& out,
                                     LayerDecodeCall* call) {
  auto bd = bank.dimensions();
  if (bd.size() < 2) return ffi::Error::InvalidArgument(std::string(op) + ": bank must be [..., K, D]");
  const ffi::DataType type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  sdm::LayerDecodeDims& dm = call->dm;
  dm.S = LeadingProduct(bd, 2);
  dm.K = bd[bd.size() - 2];
  dm.D = bd.back();
  dm.W = num_writes;
  dm.R = num_reads;
  dm.k = k;
  dm.width = proj.dimensions().size() == 0 ? -1 : proj.dimensions().back();
  dm.v_off = v_offset;
  dm.b_off = b_offset;
  dm.a_off = a_offset;
  dm.og_off = og_offset;
  dm.write_act = static_cast<int32_t>(write_activation);
  dm.read_act = static_cast<int32_t>(read_activation);
  dm.norm = static_cast<int32_t>(readout_norm);
  dm.write_scale = write_scale;
  dm.read_scale = read_scale;
  dm.eps = norm_eps;
  dm.per_write_gates = per_write_gates != 0;
  dm.bf16 = type == ffi::DataType::BF16;
  const std::string o(op);
  if (dm.W < 1 || dm.R < 1 || dm.W > dm.k || dm.R > dm.k)
    return ffi::Error::InvalidArgument(o + ": need 1 <= num_writes, num_reads <= k = " + std::to_string(dm.k) +
                                       ", got " + std::to_string(dm.W) + ", " + std::to_string(dm.R));
  const bool columns_ok = dm.width >= 0 && v_offset >= 0 && v_offset + dm.D <= dm.width && b_offset >= 0 &&
                          b_offset < dm.width && a_offset >= 0 && a_offset < dm.width &&
                          (og_offset < 0 || og_offset + dm.D <= dm.width);
  if (!columns_ok)
    return ffi::Error::InvalidArgument(o + ": the offsets of v, b, a and the output gate must lie in a "
                                       "projection row of " + std::to_string(dm.width) + " columns");
  if (write_activation < 0 || write_activation >= sdm::kNumLaneActivations || read_activation < 0 ||
      read_activation >= sdm::kNumLaneActivations || readout_norm < 0 || readout_norm >= sdm::kNumReadoutNorms)
    return ffi::Error::InvalidArgument(o + ": unknown activation or readout norm code");
  SDM_RETURN_IF_ERROR(CheckShape(op, "proj", proj, dm.S, {dm.width}));
  auto gd = gates.dimensions();
  dm.G = LeadingProduct(gd, 2);
  dm.H = gd.size() < 2 ? 0 : gd[gd.size() - 2];
  if (gd.size() < 2 || gd.back() != 2 || dm.G < 1 || dm.H < 1 || dm.S % (dm.G * dm.H) != 0)
    return ffi::Error::InvalidArgument(o + ": gates must be [..., H, 2] with G = the product of its leading dims "
                                       "and G * H dividing the streams (" + std::to_string(dm.S) + "), got " +
                                       DimsToString(gd));
  SDM_RETURN_IF_ERROR(CheckShape(op, "norm", norm, dm.G, {2, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, dm.S, {dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "out (result)", *out, dm.S, {dm.D}));
  for (auto [name, a] : {std::pair<const char*, const ffi::AnyBuffer*>{"proj", &proj}, {"bank (result)", &*bank_out},
                         {"out (result)", &*out}}) {
    SDM_RETURN_IF_ERROR(CheckValueType(op, name, *a, type));
  }
  call->in = sdm::LayerDecodeInputs{nullptr, nullptr, proj.untyped_data(), gates.typed_data(), norm.typed_data(),
                                    out->untyped_data()};
  call->bank_in = bank.untyped_data();
  call->bank = bank_out->untyped_data();
  call->bank_bytes = bank.size_bytes();
  return ffi::Error::Success();
}

inline ffi::Error PrepareLayerDecodeStep(const char* op, SDM_FFI_PARAMS(SDM_LAYER_DECODE_BUFFERS),
                                         LayerDecodeCall* call) {
  auto id = ids.dimensions();
  if (id.size() < 2) return ffi::Error::InvalidArgument(std::string(op) + ": ids must be [..., 2, k]");
  SDM_RETURN_IF_ERROR(PrepareLayerCommon(op, bank, id.back(), proj, gates, norm, num_writes, num_reads, v_offset,
                                         b_offset, a_offset, og_offset, write_activation, read_activation,
                                         per_write_gates, readout_norm, write_scale, read_scale, norm_eps, bank_out,
                                         out, call));
  SDM_RETURN_IF_ERROR(CheckShape(op, "ids", ids, call->dm.S, {2, call->dm.k}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "scores", scores, call->dm.S, {2, call->dm.k}));
  call->in.ids = ids.typed_data();
  call->in.scores = scores.typed_data();
  return ffi::Error::Success();
}

// A checked call of `sdm_layer_decode_rank_step`: the layer's call, and the top-k's dims of one row and its table.
struct LayerDecodeRankCall {
  LayerDecodeCall layer;
  sdm::ProductKeyDims pk;
  const int32_t* table;
};

inline ffi::Error PrepareLayerDecodeRankStep(const char* op, SDM_FFI_PARAMS(SDM_LAYER_DECODE_RANK_BUFFERS),
                                             LayerDecodeRankCall* call) {
  auto td = table.dimensions();
  if (td.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the candidate table must be [..., F, C], got shape " +
                                       DimsToString(td));
  }
  SDM_RETURN_IF_ERROR(ReadProductKeyDims(op, 1, factors, k, td.back(), &call->pk));
  if (td[td.size() - 2] != call->pk.F) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the candidate table has shape " + DimsToString(td) +
                                       ", expected [..., F=" + std::to_string(call->pk.F) + ", C]");
  }
  SDM_RETURN_IF_ERROR(PrepareLayerCommon(op, bank, k, proj, gates, norm, num_writes, num_reads, v_offset, b_offset,
                                         a_offset, og_offset, write_activation, read_activation, per_write_gates,
                                         readout_norm, write_scale, read_scale, norm_eps, bank_out, out,
                                         &call->layer));
  sdm::LayerDecodeDims& dm = call->layer.dm;
  for (int64_t off : {write_rank_offset, read_rank_offset}) {
    if (off < 0 || off + call->pk.width > dm.width) {
      return ffi::Error::InvalidArgument(std::string(op) + ": an address row of " +
                                         std::to_string(call->pk.width) + " columns at " + std::to_string(off) +
                                         " lies outside the projection row of " + std::to_string(dm.width));
    }
  }
  dm.rank_off[0] = write_rank_offset;
  dm.rank_off[1] = read_rank_offset;
  call->table = table.typed_data();
  return ffi::Error::Success();
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_DECODE_STEP_COMMON_H_
