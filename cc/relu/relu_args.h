// Argument checks shared by the CPU and CUDA relu handlers: both validate the same way before
// touching memory. Arrays are seen as rows x cols (cols = last axis; the Python side flattens x,
// so rows > 1 only under vmap); the mask holds ceil(cols/32) uint32 words per row.
#pragma once
#include <cstdint>
#include <utility>

#include "common/ffi_util.h"

namespace jaxops::relu {

struct View {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t words_per_row = 0;  // 0 when no mask is written
  Dtype dtype = Dtype::kInvalid;
};

inline int64_t words_for(int64_t cols) { return (cols + 31) / 32; }

// The mask must be (x.shape[:-1] + (ceil(cols/32),)) uint32, or empty when `with_mask` is 0.
inline ffi::Error check_mask(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& mask,
                             bool with_mask, View* v) {
  if (mask.element_type() != ffi::DataType::U32) return invalid_argument(op, "mask must be uint32");
  if (!with_mask) {
    if (mask.element_count() != 0) return invalid_argument(op, "mask must be empty when not requested");
    v->words_per_row = 0;
    return ffi::Error::Success();
  }
  auto dx = x.dimensions(), dm = mask.dimensions();
  bool ok = dm.size() == dx.size() && dx.size() >= 1;
  for (size_t i = 0; ok && i + 1 < dx.size(); ++i) ok = dm[i] == dx[i];
  if (!ok || dm[dm.size() - 1] != words_for(v->cols))
    return invalid_argument(op, "mask must have shape x.shape[:-1] + (ceil(x.shape[-1] / 32),)");
  v->words_per_row = words_for(v->cols);
  return ffi::Error::Success();
}

inline ffi::Error check_forward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                const ffi::AnyBuffer& mask, bool with_mask, View* v) {
  const char* op = "relu";
  if (auto err = require_float(op, x, &v->dtype); err.failure()) return err;
  if (x.dimensions().size() == 0) return invalid_argument(op, "x must have at least one axis");
  if (y.element_type() != x.element_type() || !same_dims(x, y))
    return invalid_argument(op, "output must match the input's shape and dtype");
  rows_cols(x, &v->rows, &v->cols);
  return check_mask(op, x, mask, with_mask, v);
}

inline ffi::Error check_backward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& mask,
                                 const ffi::AnyBuffer& dx, View* v) {
  const char* op = "relu_bwd";
  if (auto err = require_float(op, dy, &v->dtype); err.failure()) return err;
  if (dy.dimensions().size() == 0) return invalid_argument(op, "dy must have at least one axis");
  if (dx.element_type() != dy.element_type() || !same_dims(dx, dy))
    return invalid_argument(op, "the gradient must match the cotangent's shape and dtype");
  rows_cols(dy, &v->rows, &v->cols);
  return check_mask(op, dy, mask, true, v);
}

// FFI signature of each target, written once so the CPU and CUDA handlers cannot disagree:
// operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.

// jaxops_relu_fwd: x -> y, mask.
template <class Binding>
auto bind_forward(Binding b) {
  return buffer_rets<2>(buffer_args<1>(std::move(b)))
      .template Attr<int64_t>("with_mask");
}

// jaxops_relu_bwd: dy, mask -> dx.
template <class Binding>
auto bind_backward(Binding b) {
  return buffer_rets<1>(buffer_args<2>(std::move(b)));
}

}  // namespace jaxops::relu
