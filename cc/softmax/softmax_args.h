// Argument checks shared by the CPU and CUDA softmax handlers: both validate the same way
// before touching memory.
#pragma once
#include <cstdint>
#include <utility>

#include "common/ffi_util.h"

namespace jaxops::softmax {

// The rows x cols view every softmax kernel works on (softmax over the last axis).
struct RowsView {
  int64_t rows = 0;
  int64_t cols = 0;
  Dtype dtype = Dtype::kInvalid;
};

inline ffi::Error check_mask(const char* op, const ffi::AnyBuffer& ref, const ffi::AnyBuffer& mask,
                             int64_t masked) {
  if (!masked) return ffi::Error::Success();
  if (mask.element_type() != ffi::DataType::PRED)
    return invalid_argument(op, "where must be a boolean array");
  if (!same_dims(ref, mask)) return invalid_argument(op, "where must have the shape of x");
  return ffi::Error::Success();
}

inline ffi::Error check_forward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& mask, int64_t masked,
                                const ffi::AnyBuffer& y, RowsView* view) {
  const char* op = "softmax";
  if (auto err = require_float(op, x, &view->dtype); err.failure()) return err;
  if (y.element_type() != x.element_type() || !same_dims(x, y))
    return invalid_argument(op, "output must match the input's shape and dtype");
  if (auto err = check_mask(op, x, mask, masked); err.failure()) return err;
  rows_cols(x, &view->rows, &view->cols);
  return ffi::Error::Success();
}

inline ffi::Error check_backward(const ffi::AnyBuffer& y, const ffi::AnyBuffer& dy,
                                 const ffi::AnyBuffer& mask, int64_t masked,
                                 const ffi::AnyBuffer& dx, RowsView* view) {
  const char* op = "softmax_bwd";
  if (auto err = require_float(op, y, &view->dtype); err.failure()) return err;
  if (dy.element_type() != y.element_type() || !same_dims(y, dy))
    return invalid_argument(op, "the cotangent must match the output's shape and dtype");
  if (dx.element_type() != y.element_type() || !same_dims(y, dx))
    return invalid_argument(op, "the gradient must match the output's shape and dtype");
  if (auto err = check_mask(op, y, mask, masked); err.failure()) return err;
  rows_cols(y, &view->rows, &view->cols);
  return ffi::Error::Success();
}

// FFI signature of each target, written once so the CPU and CUDA handlers cannot disagree:
// operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.

// jaxops_softmax_fwd: x, mask -> y.
template <class Binding>
auto bind_forward(Binding b) {
  return buffer_rets<1>(buffer_args<2>(std::move(b)))
      .template Attr<int64_t>("log")
      .template Attr<int64_t>("masked");
}

// jaxops_softmax_bwd: y, dy, mask -> dx.
template <class Binding>
auto bind_backward(Binding b) {
  return buffer_rets<1>(buffer_args<3>(std::move(b)))
      .template Attr<int64_t>("log")
      .template Attr<int64_t>("masked");
}

}  // namespace jaxops::softmax
