#include "softmax/softmax_cpu.h"

#include <cmath>
#include <limits>

#include "common/cpu_float.h"

namespace jaxops::softmax {
namespace {

using cpu::from_float;
using cpu::to_float;

template <class A>
A nan_max(A a, A b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// Row sums accumulate in double: long rows stay accurate without a pairwise scheme.
template <class T>
void forward_rows(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log) {
  using A = double;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const bool* mr = mask ? mask + r * cols : nullptr;
    T* yr = y + r * cols;
    A m = neg_inf;
    for (int64_t c = 0; c < cols; ++c)
      if (!mr || mr[c]) m = nan_max<A>(m, to_float(xr[c]));
    A s = 0;
    for (int64_t c = 0; c < cols; ++c)
      if (!mr || mr[c]) s += std::exp(static_cast<A>(to_float(xr[c])) - m);
    const A log_s = std::log(s);
    for (int64_t c = 0; c < cols; ++c) {
      const A shifted = static_cast<A>(to_float(xr[c])) - m;
      A out;
      if (mr && !mr[c]) out = log ? neg_inf : A(0);
      else out = log ? shifted - log_s : std::exp(shifted) / s;
      yr[c] = from_float<T>(out);
    }
  }
}

template <class T>
void backward_rows(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                   bool log) {
  using A = double;
  for (int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    const bool* mr = mask ? mask + r * cols : nullptr;
    T* dxr = dx + r * cols;
    A s = 0;
    for (int64_t c = 0; c < cols; ++c) {
      if (mr && !mr[c]) continue;  // masked entries take no part, as in jax.nn
      if (log) {
        s += to_float(dyr[c]);
      } else {
        s += static_cast<A>(to_float(dyr[c])) * to_float(yr[c]);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      const A yv = to_float(yr[c]), g = to_float(dyr[c]);
      A out;
      if (mr && !mr[c]) out = 0;  // no gradient, also in NaN rows
      else if (log) out = g - std::exp(yv) * s;
      else out = yv * (g - s);
      dxr[c] = from_float<T>(out);
    }
  }
}

}  // namespace

bool forward_cpu(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows, int64_t cols,
                 bool log) {
  return cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    forward_rows(static_cast<const T*>(x), mask, static_cast<T*>(y), rows, cols, log);
  });
}

bool backward_cpu(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx,
                  int64_t rows, int64_t cols, bool log) {
  return cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_rows(static_cast<const T*>(y), static_cast<const T*>(dy), mask, static_cast<T*>(dx),
                  rows, cols, log);
  });
}

}  // namespace jaxops::softmax
