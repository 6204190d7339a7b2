#include "softmax/softmax_cpu.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/cpu_vec.h"

namespace jaxops::softmax {
namespace {

// Rows go through accumulation-type scratch (float; double for float64), one vectorizable pass
// at a time (cpu_vec.h); masked entries enter as -inf (forward) or 0 (backward), like the CUDA
// kernels, and their outputs are forced afterwards. Row sums: 16 float lanes, blocks in double.

template <int W, class T>
void forward_rows(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log) {
  using A = cpu::acc_t<T>;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  std::vector<A> v(cols), e(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* mr = mask ? mask + r * cols : nullptr;
    cpu::widen(x + r * cols, v.data(), cols);
    if (mr) cpu::fill_unkept(mr, v.data(), neg_inf, cols);
    const A m = cpu::lane_extremum<W, true>(v.data(), cols);
    // exp(-inf - m) = 0 for masked entries when m is finite; the row is NaN anyway otherwise.
    cpu::exp_shifted<W>(v.data(), m, e.data(), cols);
    const A s = static_cast<A>(cpu::lane_sum<W>(e.data(), cols));
    if (log) {
      const A log_s = std::log(s);
      for (int64_t c = 0; c < cols; ++c) e[c] = (v[c] - m) - log_s;
    } else {
      for (int64_t c = 0; c < cols; ++c) e[c] = e[c] / s;
    }
    if (mr) cpu::fill_unkept(mr, e.data(), log ? neg_inf : A(0), cols);
    cpu::narrow(e.data(), y + r * cols, cols);
  }
}

template <int W, class T>
void backward_rows(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                   bool log) {
  using A = cpu::acc_t<T>;
  std::vector<A> yv(cols), g(cols), t(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* mr = mask ? mask + r * cols : nullptr;
    cpu::widen(y + r * cols, yv.data(), cols);
    cpu::widen(dy + r * cols, g.data(), cols);
    // Masked entries take no part in the sum (as in jax.nn) and get no gradient, even in NaN rows.
    const auto masked_sum = [&](A* terms) {
      if (mr) cpu::fill_unkept(mr, terms, A(0), cols);
      return static_cast<A>(cpu::lane_sum<W>(terms, cols));
    };
    if (log) {
      for (int64_t c = 0; c < cols; ++c) t[c] = g[c];
      const A s = masked_sum(t.data());
      cpu::exp_shifted<W>(yv.data(), A(0), t.data(), cols);
      for (int64_t c = 0; c < cols; ++c) t[c] = g[c] - t[c] * s;
    } else {
      for (int64_t c = 0; c < cols; ++c) t[c] = g[c] * yv[c];
      const A s = masked_sum(t.data());
      for (int64_t c = 0; c < cols; ++c) t[c] = yv[c] * (g[c] - s);
    }
    if (mr) cpu::fill_unkept(mr, t.data(), A(0), cols);
    cpu::narrow(t.data(), dx + r * cols, cols);
  }
}

}  // namespace

bool forward_cpu(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows, int64_t cols,
                 bool log) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      forward_rows<w.value>(static_cast<const T*>(x), mask, static_cast<T*>(y), rows, cols, log);
    });
  });
}

bool backward_cpu(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx,
                  int64_t rows, int64_t cols, bool log) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      backward_rows<w.value>(static_cast<const T*>(y), static_cast<const T*>(dy), mask, static_cast<T*>(dx),
                             rows, cols, log);
    });
  });
}

}  // namespace jaxops::softmax
