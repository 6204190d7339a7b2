#include "layer_norm/layer_norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_float.h"

namespace jaxops::layer_norm {
namespace {

using cpu::acc_t;
using cpu::from_float;
using cpu::to_float;

template <class T>
void forward_rows(const ForwardArgs& a) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const T* x = static_cast<const T*>(a.x);
  const T* scale = static_cast<const T*>(a.scale);
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y);
  A* mean_out = static_cast<A*>(a.mean);
  A* rstd_out = static_cast<A*>(a.rstd);
  const double n = static_cast<double>(s.cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    const T* xr = x + r * s.cols;
    const int64_t g = r / s.rows_per_group;
    const T* sc = scale + g * s.cols;
    const T* bi = bias ? bias + g * s.cols : nullptr;
    T* yr = y + r * s.cols;
    // Two passes (mean, then squared deviations) keep the variance exact for data far from 0.
    // Values are centred as (x - shift) - mean_rel with shift = x[0], as the CUDA kernels do:
    // x - shift is exact, while a float32 mean of ~1e4 would itself round to 1e-3. The sums run
    // in double (the kernels' are trees): a float32 running sum of 1025 squares was off by 9e-6
    // relative, 40 ulps of rstd (found by tests/test_fuzz.py).
    const A shift = s.rms ? A(0) : static_cast<A>(to_float(xr[0]));
    A mean_rel = 0;
    if (!s.rms) {
      double sum = 0;
      for (int64_t c = 0; c < s.cols; ++c) sum += static_cast<A>(to_float(xr[c])) - shift;
      mean_rel = static_cast<A>(sum / n);
    }
    auto centred = [&](int64_t c) { return (static_cast<A>(to_float(xr[c])) - shift) - mean_rel; };
    double sq = 0;
    for (int64_t c = 0; c < s.cols; ++c) sq += static_cast<double>(centred(c)) * centred(c);
    const A rstd = A(1) / std::sqrt(static_cast<A>(sq / n) + static_cast<A>(s.epsilon));
    for (int64_t c = 0; c < s.cols; ++c) {
      A v = centred(c) * rstd * static_cast<A>(to_float(sc[c]));
      if (bi) v += static_cast<A>(to_float(bi[c]));
      yr[c] = from_float<T>(v);
    }
    const A mean = shift + mean_rel;
    if (mean_out) mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

template <class T>
void backward_rows(const BackwardArgs& a) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const T* x = static_cast<const T*>(a.x);
  const T* scale = static_cast<const T*>(a.scale);
  const A* mean_in = static_cast<const A*>(a.mean);
  const A* rstd_in = static_cast<const A*>(a.rstd);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const double n = static_cast<double>(s.cols);
  std::vector<double> dscale(s.cols), dbias(s.cols);  // double sums, as in forward_rows
  for (int64_t g = 0; g < s.groups; ++g) {
    std::fill(dscale.begin(), dscale.end(), 0.0);
    std::fill(dbias.begin(), dbias.end(), 0.0);
    const T* sc = scale + g * s.cols;
    for (int64_t r = g * s.rows_per_group; r < (g + 1) * s.rows_per_group; ++r) {
      const T* xr = x + r * s.cols;
      const T* dyr = dy + r * s.cols;
      T* dxr = dx + r * s.cols;
      const A mean = mean_in ? mean_in[r] : A(0), rstd = rstd_in[r];
      // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * scale (no mean(g) for rms).
      double sum_g = 0, sum_gx = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        const A xhat = (static_cast<A>(to_float(xr[c])) - mean) * rstd;
        const A d = to_float(dyr[c]);
        const A gv = d * static_cast<A>(to_float(sc[c]));
        sum_g += gv;
        sum_gx += gv * xhat;
        dscale[c] += d * xhat;
        dbias[c] += d;
      }
      const A mg = s.rms ? A(0) : static_cast<A>(sum_g / n), mgx = static_cast<A>(sum_gx / n);
      for (int64_t c = 0; c < s.cols; ++c) {
        const A xhat = (static_cast<A>(to_float(xr[c])) - mean) * rstd;
        const A gv = static_cast<A>(to_float(dyr[c])) * static_cast<A>(to_float(sc[c]));
        dxr[c] = from_float<T>(rstd * (gv - mg - xhat * mgx));
      }
    }
    T* ds = static_cast<T*>(a.dscale) + g * s.cols;
    for (int64_t c = 0; c < s.cols; ++c) ds[c] = from_float<T>(static_cast<A>(dscale[c]));
    if (a.dbias) {
      T* db = static_cast<T*>(a.dbias) + g * s.cols;
      for (int64_t c = 0; c < s.cols; ++c) db[c] = from_float<T>(static_cast<A>(dbias[c]));
    }
  }
}

}  // namespace

bool forward_cpu(const ForwardArgs& a) {
  return cpu::dispatch_float(a.dtype, [&](auto tag) { forward_rows<decltype(tag)>(a); });
}

bool backward_cpu(const BackwardArgs& a) {
  return cpu::dispatch_float(a.dtype, [&](auto tag) { backward_rows<decltype(tag)>(a); });
}

}  // namespace jaxops::layer_norm
