#include "relu/relu_cpu.h"

#include <cmath>

#include "common/cpu_float.h"

namespace jaxops::relu {
namespace {

using cpu::from_float;
using cpu::to_float;

template <class T>
void forward_rows(const T* x, T* y, uint32_t* mask, int64_t rows, int64_t cols, int64_t wpr) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    uint32_t* mr = mask ? mask + r * wpr : nullptr;
    for (int64_t w = 0; mr && w < wpr; ++w) mr[w] = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const auto v = to_float(xr[c]);
      const bool pos = v > 0;
      // NaN propagates like jax.nn.relu; everything else not positive becomes +0.
      yr[c] = pos || std::isnan(v) ? xr[c] : from_float<T>(decltype(v)(0));
      if (mr && pos) mr[c >> 5] |= 1u << (c & 31);
    }
  }
}

template <class T>
void backward_rows(const T* dy, const uint32_t* mask, T* dx, int64_t rows, int64_t cols, int64_t wpr) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const uint32_t* mr = mask + r * wpr;
    T* dxr = dx + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const bool pass = (mr[c >> 5] >> (c & 31)) & 1u;
      dxr[c] = pass ? dyr[c] : from_float<T>(decltype(to_float(dyr[c]))(0));
    }
  }
}

}  // namespace

bool forward_cpu(Dtype dtype, const void* x, void* y, uint32_t* mask, int64_t rows, int64_t cols,
                 int64_t words_per_row) {
  return cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    forward_rows(static_cast<const T*>(x), static_cast<T*>(y), words_per_row ? mask : nullptr, rows,
                 cols, words_per_row);
  });
}

bool backward_cpu(Dtype dtype, const void* dy, const uint32_t* mask, void* dx, int64_t rows,
                  int64_t cols, int64_t words_per_row) {
  return cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_rows(static_cast<const T*>(dy), mask, static_cast<T*>(dx), rows, cols, words_per_row);
  });
}

}  // namespace jaxops::relu
