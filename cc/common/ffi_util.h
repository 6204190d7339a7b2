// Helpers every FFI handler uses: dtype mapping, shape products, uniform error messages.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "common/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jaxops {

namespace ffi = xla::ffi;

inline Dtype to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return Dtype::kF32;
    case ffi::DataType::F64: return Dtype::kF64;
    case ffi::DataType::BF16: return Dtype::kBF16;
    case ffi::DataType::F16: return Dtype::kF16;
    default: return Dtype::kInvalid;
  }
}

// `b` with N more ffi::AnyBuffer operands / results: the buffer lists of the bind_* signatures
// in each family's args header (N >= 1; a Binding can only be extended as a temporary).
template <int N, class Binding>
auto buffer_args(Binding&& b) {
  if constexpr (N == 1) return std::move(b).template Arg<ffi::AnyBuffer>();
  else return buffer_args<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}
template <int N, class Binding>
auto buffer_rets(Binding&& b) {
  if constexpr (N == 1) return std::move(b).template Ret<ffi::AnyBuffer>();
  else return buffer_rets<N - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
}

inline ffi::Error invalid_argument(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxops.") + op + ": " + what);
}

// Float dtype of `buf`, or an error naming the op when it is not float32/64, bfloat16, float16.
inline ffi::Error require_float(const char* op, const ffi::AnyBuffer& buf, Dtype* out) {
  *out = to_dtype(buf.element_type());
  if (*out == Dtype::kInvalid) {
    return invalid_argument(op, "unsupported element type " +
                                    std::to_string(static_cast<int>(buf.element_type())) +
                                    " (expected float32, float64, bfloat16 or float16)");
  }
  return ffi::Error::Success();
}

// Product of dims[begin, end).
inline int64_t dims_product(const ffi::AnyBuffer::Dimensions& dims, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= dims[i];
  return n;
}

inline bool same_dims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != db.size()) return false;
  for (size_t i = 0; i < da.size(); ++i)
    if (da[i] != db[i]) return false;
  return true;
}

// Splits a buffer into (rows, cols) with cols the last dimension; a rank-0 buffer is one row of one.
inline void rows_cols(const ffi::AnyBuffer& buf, int64_t* rows, int64_t* cols) {
  auto dims = buf.dimensions();
  if (dims.size() == 0) {
    *rows = 1;
    *cols = 1;
    return;
  }
  *cols = dims[dims.size() - 1];
  *rows = dims_product(dims, 0, dims.size() - 1);
}

}  // namespace jaxops
