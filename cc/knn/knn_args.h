// Argument checks shared by the CPU and CUDA handlers of jaxops_knn_select: both validate the
// same way, and return an FFI error naming the op, before touching memory.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_util.h"
#include "knn/knn_view.h"

namespace jaxops::knn {

inline bool is_f32(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::F32; }
inline bool is_s32(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::S32; }

inline bool dims_equal(const ffi::AnyBuffer::Dimensions& d, size_t begin, size_t end,
                       const ffi::AnyBuffer::Dimensions& e, size_t ebegin) {
  for (size_t i = begin; i < end; ++i)
    if (d[i] != e[ebegin + (i - begin)]) return false;
  return true;
}

// tile (..., rows, cols) f32; qn (..., rows) f32; rn (..., cols) f32; prev_d/out_d (..., rows, k)
// f32; prev_i/out_i (..., rows, k) s32; base: one int32 per batch entry (or one for all).
inline ffi::Error check_select(const ffi::AnyBuffer& tile, const ffi::AnyBuffer& qn,
                               const ffi::AnyBuffer& rn, const ffi::AnyBuffer& prev_d,
                               const ffi::AnyBuffer& prev_i, const ffi::AnyBuffer& base,
                               const ffi::AnyBuffer& out_d, const ffi::AnyBuffer& out_i,
                               int64_t n, int64_t mode, SelectView* v) {
  const char* op = "knn";
  auto td = tile.dimensions();
  if (td.size() < 2) return invalid_argument(op, "the distance tile must have rank >= 2");
  const size_t lead = td.size() - 2;
  if (!is_f32(tile) || !is_f32(qn) || !is_f32(rn) || !is_f32(prev_d) || !is_f32(out_d))
    return invalid_argument(op, "tile, norms and distance lists must be float32");
  if (!is_s32(prev_i) || !is_s32(out_i) || !is_s32(base))
    return invalid_argument(op, "index lists and the tile base must be int32");
  if (mode != 0 && mode != 1) return invalid_argument(op, "mode must be 0 or 1, got " + std::to_string(mode));
  v->batch = dims_product(td, 0, lead);
  v->rows = td[lead];
  v->cols = td[lead + 1];
  auto qd = qn.dimensions(), rd = rn.dimensions(), pd = prev_d.dimensions();
  if (qd.size() != lead + 1 || !dims_equal(td, 0, lead + 1, qd, 0))
    return invalid_argument(op, "query norms must have shape (..., rows)");
  if (rd.size() != lead + 1 || !dims_equal(td, 0, lead, rd, 0) || rd[lead] != v->cols)
    return invalid_argument(op, "reference norms must have shape (..., cols)");
  if (pd.size() != lead + 2 || !dims_equal(td, 0, lead + 1, pd, 0))
    return invalid_argument(op, "running lists must have shape (..., rows, k)");
  v->k = pd[lead + 1];
  if (!same_dims(prev_d, prev_i) || !same_dims(prev_d, out_d) || !same_dims(prev_d, out_i))
    return invalid_argument(op, "running and output lists must share one shape (..., rows, k)");
  if (v->k < 1) return invalid_argument(op, "k must be >= 1, got " + std::to_string(v->k));
  if (n < 0 || n > INT32_MAX)
    return invalid_argument(op, "the number of references must be in [0, 2^31), got " + std::to_string(n));
  const int64_t nbase = base.element_count();
  if (nbase != 1 && nbase != v->batch)
    return invalid_argument(op, "the tile base must hold one value or one per batch entry");
  v->base_per_batch = nbase != 1;
  v->n = n;
  v->distances = mode == 1;
  return ffi::Error::Success();
}

// FFI signature of jaxops_knn_select, written once so the CPU and CUDA handlers cannot disagree:
// operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.
// jaxops_knn_select: tile, qn, rn, prev_d, prev_i, base -> out_d, out_i.
template <class Binding>
auto bind_select(Binding b) {
  return buffer_rets<2>(buffer_args<6>(std::move(b)))
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("mode");
}

}  // namespace jaxops::knn
