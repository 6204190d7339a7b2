#include "layer_norm/layer_norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/cpu_parts.h"
#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::layer_norm {
namespace {

using cpu::acc_t;

// Rows go through accumulation-type scratch a pass at a time, so the loops vectorize
// (cpu_rows.h); the row statistics are sums in double (cpu::dsum, cpu_sums.h), as before.

template <int W, class T>
void forward_rows(const ForwardArgs& a, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const T* x = static_cast<const T*>(a.x);
  const T* scale = static_cast<const T*>(a.scale);
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y);
  A* mean_out = static_cast<A*>(a.mean);
  A* rstd_out = static_cast<A*>(a.rstd);
  const int64_t n = s.cols;
  std::vector<A> v(std::is_same_v<T, A> ? 0 : n), sc(n), bi(bias ? n : 0);
  int64_t group = -1;
  for (int64_t r = r0; r < r1; ++r) {
    if (const int64_t g = r / s.rows_per_group; g != group) {
      group = g;
      cpu::widen(scale + g * n, sc.data(), n);
      if (bias) cpu::widen(bias + g * n, bi.data(), n);
    }
    // float / double rows are read and written in place; 16-bit ones through the scratch row.
    const A* xv = cpu::acc_row(x + r * n, v.data(), n);
    // Two passes (mean, then squared deviations) keep the variance exact for data far from 0.
    // Values are centred as (x - shift) - mean_rel with shift = x[0], as the CUDA kernels do:
    // x - shift is exact, while a float32 mean of ~1e4 would itself round to 1e-3. The sums run
    // in double (the kernels' are trees): a float32 running sum of 1025 squares was off by 9e-6
    // relative, 40 ulps of rstd (found by tests/test_fuzz.py).
    const A shift = s.rms ? A(0) : xv[0];
    const A mean_rel = s.rms ? A(0) : static_cast<A>(cpu::dsum<W>(xv, n, shift) / static_cast<double>(n));
    const double sq = cpu::dsum<W, true>(xv, n, shift, mean_rel);
    const A rstd = A(1) / std::sqrt(static_cast<A>(sq / static_cast<double>(n)) + static_cast<A>(s.epsilon));
    A* out = cpu::acc_out(y + r * n, v.data());
    if (bias)
      for (int64_t c = 0; c < n; ++c) out[c] = ((xv[c] - shift) - mean_rel) * rstd * sc[c] + bi[c];
    else
      for (int64_t c = 0; c < n; ++c) out[c] = ((xv[c] - shift) - mean_rel) * rstd * sc[c];
    cpu::narrow_row(v.data(), y + r * n, n);
    if (mean_out) mean_out[r] = shift + mean_rel;
    rstd_out[r] = rstd;
  }
}

// Rows whose dscale / dbias terms are summed in float before they join the double column sums:
// converting every term to double cost two conversions an element (session 54), while a float
// partial of kColumnRun terms carries at most that many roundings of 2^-24 relative.
constexpr int64_t kColumnRun = 8;

// Rows [r0, r1) of group g: dx, and the group's dscale / dbias terms of those rows summed in
// double into ds / db (n each; db unused for rms_norm), in row order.
template <int W, class T>
void backward_rows(const BackwardArgs& a, int64_t g, int64_t r0, int64_t r1, double* ds, double* db) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const T* x = static_cast<const T*>(a.x);
  const T* scale = static_cast<const T*>(a.scale);
  const A* mean_in = static_cast<const A*>(a.mean);
  const A* rstd_in = static_cast<const A*>(a.rstd);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const int64_t n = s.cols;
  constexpr bool kInPlace = std::is_same_v<T, A>;  // float / double rows need no scratch copy
  std::vector<A> sc(n), part_s(n), part_b(n), gv(n), t(n), xw(kInPlace ? 0 : n), dw(kInPlace ? 0 : n);
  const auto flush = [&] {
    for (int64_t c = 0; c < n; ++c) ds[c] += static_cast<double>(part_s[c]), part_s[c] = A(0);
    for (int64_t c = 0; c < n; ++c) db[c] += static_cast<double>(part_b[c]), part_b[c] = A(0);
  };
  std::fill(ds, ds + n, 0.0);
  std::fill(db, db + n, 0.0);
  cpu::widen(scale + g * n, sc.data(), n);
  for (int64_t r = r0; r < r1; ++r) {
    const A mean = mean_in ? mean_in[r] : A(0), rstd = rstd_in[r];
    const A* xr = cpu::acc_row(x + r * n, xw.data(), n);
    const A* dr = cpu::acc_row(dy + r * n, dw.data(), n);
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * scale (no mean(g) for rms).
    for (int64_t c = 0; c < n; ++c) {
      const A xhat = (xr[c] - mean) * rstd;
      gv[c] = dr[c] * sc[c];
      t[c] = gv[c] * xhat;
      part_s[c] += dr[c] * xhat;
      part_b[c] += dr[c];
    }
    if ((r - r0 + 1) % kColumnRun == 0) flush();
    const double sum_g = s.rms ? 0.0 : cpu::dsum<W>(gv.data(), n), sum_gx = cpu::dsum<W>(t.data(), n);
    const A mg = static_cast<A>(sum_g / static_cast<double>(n)), mgx = static_cast<A>(sum_gx / static_cast<double>(n));
    A* out = cpu::acc_out(dx + r * n, t.data());
    for (int64_t c = 0; c < n; ++c) out[c] = rstd * (gv[c] - mg - ((xr[c] - mean) * rstd) * mgx);
    cpu::narrow_row(t.data(), dx + r * n, n);
  }
  flush();
}

// dscale (and dbias) of group g from the sums of its `parts` consecutive row ranges (group_sums:
// 2 n doubles a range, dscale's then dbias's), added in order.
template <class T>
void store_param_grads(const BackwardArgs& a, int64_t g, int64_t parts, const double* group_sums) {
  using A = acc_t<T>;
  const int64_t n = a.shape.cols;
  std::vector<A> t(n);
  for (int k = 0; k < 2; ++k) {
    T* out = static_cast<T*>(k == 0 ? a.dscale : a.dbias);
    if (out == nullptr) continue;
    for (int64_t c = 0; c < n; ++c) {
      double v = 0.0;
      for (int64_t p = 0; p < parts; ++p) v += group_sums[(2 * p + k) * n + c];
      t[c] = static_cast<A>(v);
    }
    cpu::narrow(t.data(), out + g * n, n);
  }
}

}  // namespace

bool forward_cpu(const ForwardArgs& a, int64_t r0, int64_t r1) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(a.dtype, [&](auto tag) { forward_rows<w.value, decltype(tag)>(a, r0, r1); });
  });
}

int64_t backward_parts(const Shape& s) {
  return cpu::row_parts(s.groups, s.rows_per_group, s.cols, kColumnRun);
}

bool backward_cpu(const BackwardArgs& a, int64_t parts, int64_t i0, int64_t i1, double* sums) {
  const Shape& s = a.shape;
  // One range a group: its sums go straight to dscale / dbias, through a scratch of 2 n doubles
  // (not a buffer of 2 n a group: many small vmapped groups would make that larger than x).
  std::vector<double> own(sums == nullptr ? 2 * s.cols : 0);
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = i / parts;
        int64_t r0, r1;
        cpu::part_rows(s.rows_per_group, parts, i % parts, &r0, &r1);
        double* piece = sums != nullptr ? sums + 2 * i * s.cols : own.data();
        backward_rows<w.value, T>(a, g, g * s.rows_per_group + r0, g * s.rows_per_group + r1, piece,
                                  piece + s.cols);
        if (sums == nullptr) store_param_grads<T>(a, g, 1, piece);
      }
    });
  });
}

bool store_param_grads_cpu(const BackwardArgs& a, int64_t parts, int64_t g0, int64_t g1, const double* sums) {
  return cpu::dispatch_float(a.dtype, [&](auto tag) {
    for (int64_t g = g0; g < g1; ++g)
      store_param_grads<decltype(tag)>(a, g, parts, sums + 2 * g * parts * a.shape.cols);
  });
}

}  // namespace jaxops::layer_norm
