#include "softmax/softmax_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/cpu_bits.h"
#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::softmax {
namespace {

// 16-bit rows go through float scratch, float / double rows are read and written in place, one
// vectorizable pass at a time (cpu_rows.h, cpu_sums.h); masked entries enter as -inf (forward)
// or 0 (backward), like the CUDA kernels, and their outputs are forced afterwards. Row sums: 16
// float lanes, blocks in double.

template <int W, class T>
void forward_rows(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log) {
  using A = cpu::acc_t<T>;
  constexpr bool kInPlace = std::is_same_v<T, A>;  // float / double rows need no scratch
  const A neg_inf = -std::numeric_limits<A>::infinity();
  std::vector<A> v(kInPlace && !mask ? 0 : cols), e(kInPlace ? 0 : cols);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* mr = mask ? mask + r * cols : nullptr;
    const A* xv = v.data();
    if constexpr (kInPlace) {
      if (mr) std::copy(x + r * cols, x + (r + 1) * cols, v.data());
      else xv = x + r * cols;
    } else {
      cpu::widen(x + r * cols, v.data(), cols);
    }
    if (mr) cpu::fill_unkept(mr, v.data(), neg_inf, cols);
    const A m = cpu::lane_extremum<W, true>(xv, cols);
    A* out = cpu::acc_out(y + r * cols, e.data());
    // exp(-inf - m) = 0 for masked entries when m is finite; the row is NaN anyway otherwise.
    if (log) {  // only the sum of the exps: lane_exp_sum, without storing them
      const A log_s = std::log(static_cast<A>(cpu::lane_exp_sum<W>(xv, m, cols)));
      for (int64_t c = 0; c < cols; ++c) out[c] = (xv[c] - m) - log_s;
    } else {
      cpu::exp_shifted<W>(xv, m, out, cols);
      const A s = static_cast<A>(cpu::lane_sum<W>(out, cols));
      for (int64_t c = 0; c < cols; ++c) out[c] = out[c] / s;
    }
    if (mr) cpu::fill_unkept(mr, out, log ? neg_inf : A(0), cols);
    cpu::narrow_row(e.data(), y + r * cols, cols);
  }
}

template <int W, class T>
void backward_rows(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                   bool log) {
  using A = cpu::acc_t<T>;
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> yv(kInPlace ? 0 : cols), g(kInPlace ? 0 : cols), t(kInPlace ? 0 : cols);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* mr = mask ? mask + r * cols : nullptr;
    const A* ys = cpu::acc_row(y + r * cols, yv.data(), cols);
    const A* gs = cpu::acc_row(dy + r * cols, g.data(), cols);
    A* out = cpu::acc_out(dx + r * cols, t.data());
    // Masked entries take no part in the sum (as in jax.nn) and get no gradient, even in NaN rows.
    const auto masked_sum = [&](A* terms) {
      if (mr) cpu::fill_unkept(mr, terms, A(0), cols);
      return static_cast<A>(cpu::lane_sum<W>(terms, cols));
    };
    if (log) {
      std::copy(gs, gs + cols, out);
      const A s = masked_sum(out);
      cpu::exp_shifted<W>(ys, A(0), out, cols);
      for (int64_t c = 0; c < cols; ++c) out[c] = gs[c] - out[c] * s;
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = gs[c] * ys[c];
      const A s = masked_sum(out);
      for (int64_t c = 0; c < cols; ++c) out[c] = ys[c] * (gs[c] - s);
    }
    if (mr) cpu::fill_unkept(mr, out, A(0), cols);
    cpu::narrow_row(t.data(), dx + r * cols, cols);
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
