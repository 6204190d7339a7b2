#include "layer_norm/layer_norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::layer_norm {
namespace {

using cpu::acc_t;

// Rows go through accumulation-type scratch a pass at a time, so the loops vectorize
// (cpu_rows.h); the row statistics are sums in double (cpu::dsum, cpu_sums.h), as before.

template <int W, class T>
void forward_rows(const ForwardArgs& a) {
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
  for (int64_t r = 0; r < s.rows; ++r) {
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

template <int W, class T>
void backward_rows(const BackwardArgs& a) {
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
  std::vector<double> dscale(n), dbias(n);
  std::vector<A> sc(n), part_s(n), part_b(n), gv(n), t(n), xw(kInPlace ? 0 : n), dw(kInPlace ? 0 : n);
  const auto flush = [&] {
    for (int64_t c = 0; c < n; ++c) dscale[c] += static_cast<double>(part_s[c]), part_s[c] = A(0);
    for (int64_t c = 0; c < n; ++c) dbias[c] += static_cast<double>(part_b[c]), part_b[c] = A(0);
  };
  for (int64_t g = 0; g < s.groups; ++g) {
    std::fill(dscale.begin(), dscale.end(), 0.0);
    std::fill(dbias.begin(), dbias.end(), 0.0);
    std::fill(part_s.begin(), part_s.end(), A(0));
    std::fill(part_b.begin(), part_b.end(), A(0));
    cpu::widen(scale + g * n, sc.data(), n);
    const int64_t first = g * s.rows_per_group, last = first + s.rows_per_group;
    for (int64_t r = first; r < last; ++r) {
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
      if ((r - first + 1) % kColumnRun == 0) flush();
      const double sum_g = s.rms ? 0.0 : cpu::dsum<W>(gv.data(), n), sum_gx = cpu::dsum<W>(t.data(), n);
      const A mg = static_cast<A>(sum_g / static_cast<double>(n)), mgx = static_cast<A>(sum_gx / static_cast<double>(n));
      A* out = cpu::acc_out(dx + r * n, t.data());
      for (int64_t c = 0; c < n; ++c) out[c] = rstd * (gv[c] - mg - ((xr[c] - mean) * rstd) * mgx);
      cpu::narrow_row(t.data(), dx + r * n, n);
    }
    flush();
    for (int64_t c = 0; c < n; ++c) t[c] = static_cast<A>(dscale[c]);
    cpu::narrow(t.data(), static_cast<T*>(a.dscale) + g * n, n);
    if (a.dbias) {
      for (int64_t c = 0; c < n; ++c) t[c] = static_cast<A>(dbias[c]);
      cpu::narrow(t.data(), static_cast<T*>(a.dbias) + g * n, n);
    }
  }
}

}  // namespace

bool forward_cpu(const ForwardArgs& a) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(a.dtype, [&](auto tag) { forward_rows<w.value, decltype(tag)>(a); });
  });
}

bool backward_cpu(const BackwardArgs& a) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(a.dtype, [&](auto tag) { backward_rows<w.value, decltype(tag)>(a); });
  });
}

}  // namespace jaxops::layer_norm
