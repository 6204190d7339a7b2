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

// One vectorizable pass at a time (cpu_rows.h, cpu_sums.h). The forward reads float / double rows
// in place and widens 16-bit ones into float scratch first (its max and exp passes ran 5-8 %
// slower on 16-bit loads); its last pass writes the output type. The backward reads float32 and
// 16-bit rows in place and writes the output in its second pass (session 55: before, 16-bit rows
// were widened and narrowed in passes of their own, and the products or dy copied out). Masked
// entries enter the forward as -inf through a float copy of the row, like the CUDA kernels, and
// are forced afterwards where the row's maximum is not finite; the backward selects their terms
// and outputs to 0. Row sums: 16 float lanes, blocks in double.

// One row: xs the input row in the accumulation type (or its masked copy), yr the output;
// scratch holds the exps of 16-bit rows (float / double rows keep them in yr). Returns the row's
// maximum.
// xs may also be the stored row itself (S = T: cpu::two_passes_in_place).
template <int W, class T, class A, class S>
A forward_row(const S* xs, T* yr, A* scratch, int64_t cols, bool log) {
  const A m = cpu::lane_extremum<W, true>(xs, cols);
  // exp(-inf - m) = 0 for masked entries when m is finite; the row is NaN anyway otherwise.
  if (log) {  // only the sum of the exps: lane_exp_sum, without storing them
    const A log_s = std::log(static_cast<A>(cpu::lane_exp_sum<W>(xs, m, cols)));
    for (int64_t c = 0; c < cols; ++c)
      yr[c] = cpu::from_float<T>((static_cast<A>(cpu::to_float(xs[c])) - m) - log_s);
  } else {
    A* e = cpu::acc_out(yr, scratch);
    cpu::exp_shifted<W>(xs, m, e, cols);
    const A s = static_cast<A>(cpu::lane_sum<W>(e, cols));
    for (int64_t c = 0; c < cols; ++c) yr[c] = cpu::from_float<T>(e[c] / s);
  }
  return m;
}

template <int W, class T>
void forward_rows(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log) {
  using A = cpu::acc_t<T>;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> v(kInPlace && !mask ? 0 : cols), e(kInPlace || log ? 0 : cols);
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y + r * cols;
    if (mask) {
      const bool* mr = mask + r * cols;
      cpu::widen_kept(mr, x + r * cols, v.data(), neg_inf, cols);
      // With a finite maximum the masked entries come out as exp(-inf) = 0 or -inf already; a row
      // whose maximum is -inf (all masked), +inf or NaN has them forced.
      if (!std::isfinite(forward_row<W>(v.data(), yr, e.data(), cols, log)))
        cpu::fill_unkept(mr, yr, cpu::from_float<T>(log ? neg_inf : A(0)), cols);
    } else if (cpu::two_passes_in_place<W, T>(cols)) {  // float rows, short bf16 ones
      forward_row<W>(x + r * cols, yr, e.data(), cols, log);
    } else {
      forward_row<W>(cpu::acc_row(x + r * cols, v.data(), cols), yr, e.data(), cols, log);
    }
  }
}

// Rows of float32 / 16-bit types: the sum, then the output, nothing stored between them (but
// log_softmax's exps for 16-bit or masked rows; exps: cols floats for 16-bit rows). Masked entries
// (keep[i] == 0, kMasked) take no part in the sum (as in jax.nn) and get no gradient, even in NaN
// rows: their terms and outputs are selected to 0.
template <int W, bool kMasked, class T>
void backward_row_in_place(const T* ys, const T* gs, const bool* keep, T* out, float* exps, int64_t cols,
                           bool log) {
  using V = cpu::Vec<W>;
  const uint8_t* k = reinterpret_cast<const uint8_t*>(keep);
  const auto kept = [k](int64_t i, float v) {
    if constexpr (kMasked) return cpu::select_bits(k[i] != 0, v, 0.0f);
    else return v;
  };
  const auto kept_vec = [k](int64_t i, typename V::F v) {
    if constexpr (kMasked) {
      typename V::I m;
      for (int j = 0; j < W; ++j) m[j] = -static_cast<int32_t>(k[i + j] != 0);
      return V::floats(V::bits(v) & m);
    } else {
      return v;
    }
  };
  if (!log) {  // dx = y (dy - sum(dy y))
    float s;
    if constexpr (kMasked)
      s = static_cast<float>(cpu::lane_sum_of<W>(
          cols, [&](int64_t i) { return kept_vec(i, cpu::load_floats<W>(gs + i) * cpu::load_floats<W>(ys + i)); },
          [&](int64_t i) { return kept(i, cpu::to_float(gs[i]) * cpu::to_float(ys[i])); }));
    else
      s = static_cast<float>(cpu::lane_dot<W>(gs, ys, cols));
    for (int64_t c = 0; c < cols; ++c) out[c] = cpu::from_float<T>(kept(c, cpu::to_float(ys[c]) * (cpu::to_float(gs[c]) - s)));
    return;
  }
  // dx = dy - exp(y) sum(dy)
  const float s = static_cast<float>(cpu::lane_sum_of<W>(
      cols, [&](int64_t i) { return kept_vec(i, cpu::load_floats<W>(gs + i)); },
      [&](int64_t i) { return kept(i, cpu::to_float(gs[i])); }));
  if constexpr (std::is_same_v<T, float> && !kMasked) {  // Vec::exp a vector at a time, the last padded
    int64_t c = 0;
    for (; c + W <= cols; c += W) V::store(out + c, V::load(gs + c) - V::exp(V::load(ys + c)) * s);
    if (c < cols) {
      float py[W] = {}, pg[W] = {}, o[W];
      for (int64_t j = c; j < cols; ++j) py[j - c] = ys[j], pg[j - c] = gs[j];
      V::store(o, V::load(pg) - V::exp(V::load(py)) * s);
      for (int64_t j = c; j < cols; ++j) out[j] = o[j - c];
    }
  } else {
    // The exps first: one loop of two 16-bit loads, the exp and a 16-bit store kept more constants
    // than there are registers (892 against 676 us in the harness, bf16 1024 x 1024).
    float* e = cpu::acc_out(out, exps);
    cpu::exp_shifted<W>(ys, 0.0f, e, cols);
    for (int64_t c = 0; c < cols; ++c) out[c] = cpu::from_float<T>(kept(c, cpu::to_float(gs[c]) - e[c] * s));
  }
}

template <int W, class T>
void backward_rows(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                   bool log) {
  using A = cpu::acc_t<T>;
  if constexpr (std::is_same_v<A, float>) {
    std::vector<float> exps(std::is_same_v<T, float> ? 0 : cols);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t o = r * cols;
      if (mask) backward_row_in_place<W, true>(y + o, dy + o, mask + o, dx + o, exps.data(), cols, log);
      else backward_row_in_place<W, false>(y + o, dy + o, nullptr, dx + o, exps.data(), cols, log);
    }
  } else {  // double rows: a pass at a time in place
    for (int64_t r = 0; r < rows; ++r) {
      const bool* mr = mask ? mask + r * cols : nullptr;
      const A* ys = y + r * cols;
      const A* gs = dy + r * cols;
      A* out = dx + r * cols;
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
    }
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
