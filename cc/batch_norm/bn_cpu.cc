#include "batch_norm/bn_cpu.h"

#include <cmath>
#include <vector>

#include "batch_norm/bn_math.h"
#include "common/cpu_float.h"

namespace jaxops::batch_norm {
namespace {

using cpu::acc_t;
using cpu::from_float;
using cpu::to_float;

inline bool bit(const uint32_t* mask, int64_t e) { return (mask[e >> 5] >> (e & 31)) & 1u; }

template <class T>
void stats(const View& v, const T* x, acc_t<T>* mean, acc_t<T>* var) {
  const int64_t R = v.rows, C = v.channels;
  std::vector<double> s(C), q(C);
  for (int64_t g = 0; g < v.groups; ++g) {
    const T* xg = x + g * R * C;
    std::fill(s.begin(), s.end(), 0.0);
    std::fill(q.begin(), q.end(), 0.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) s[c] += to_float(xg[r * C + c]);
    for (int64_t c = 0; c < C; ++c) s[c] /= static_cast<double>(R);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const double d = to_float(xg[r * C + c]) - s[c];
        q[c] += d * d;
      }
    for (int64_t c = 0; c < C; ++c) {
      mean[g * C + c] = static_cast<acc_t<T>>(s[c]);
      var[g * C + c] = static_cast<acc_t<T>>(q[c] / static_cast<double>(R));
    }
  }
}

template <class T>
void apply(const View& v, const T* x, const acc_t<T>* scale, const acc_t<T>* bias,
           const acc_t<T>* mean, const acc_t<T>* var, const T* res, T* y, uint32_t* mask, double eps,
           bool relu) {
  using A = acc_t<T>;
  const int64_t L = v.elements_per_group(), C = v.channels;
  std::vector<Coef<A>> coef(C);
  for (int64_t g = 0; g < v.groups; ++g) {
    const int64_t p = g * C;
    for (int64_t c = 0; c < C; ++c)
      coef[c] = forward_coef<A>(scale[p + c], bias[p + c], mean[p + c], var[p + c], A(eps));
    uint32_t* mg = v.mask_words ? mask + g * v.mask_words : nullptr;
    for (int64_t w = 0; mg && w < v.mask_words; ++w) mg[w] = 0;
    for (int64_t e = 0; e < L; ++e) {
      const int64_t i = g * L + e;
      const Coef<A>& k = coef[e % C];
      A z = (static_cast<A>(to_float(x[i])) - k.shift) * k.a + k.b;
      if (res) z += static_cast<A>(to_float(res[i]));
      if (relu) {
        const bool pos = z > 0;
        if (!(pos || std::isnan(z))) z = A(0);
        if (mg && pos) mg[e >> 5] |= 1u << (e & 31);
      }
      y[i] = from_float<T>(z);
    }
  }
}

template <class T>
void backward_reduce(const View& v, const T* dy, const T* x, const uint32_t* mask,
                     const acc_t<T>* mean, const acc_t<T>* var, acc_t<T>* sum_dy,
                     acc_t<T>* sum_dyxhat, double eps) {
  using A = acc_t<T>;
  const int64_t L = v.elements_per_group(), C = v.channels;
  std::vector<double> s(C), q(C);
  for (int64_t g = 0; g < v.groups; ++g) {
    std::fill(s.begin(), s.end(), 0.0);
    std::fill(q.begin(), q.end(), 0.0);
    const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
    for (int64_t e = 0; e < L; ++e) {
      const int64_t i = g * L + e, c = e % C;
      if (mg && !bit(mg, e)) continue;
      const double d = to_float(dy[i]);
      s[c] += d;
      q[c] += d * (static_cast<A>(to_float(x[i])) - mean[g * C + c]);
    }
    for (int64_t c = 0; c < C; ++c) {
      sum_dy[g * C + c] = static_cast<A>(s[c]);
      sum_dyxhat[g * C + c] = static_cast<A>(q[c]) * inv_std<A>(var[g * C + c], A(eps));
    }
  }
}

template <class T>
void backward_dx(const View& v, const T* dy, const T* x, const uint32_t* mask, const acc_t<T>* scale,
                 const acc_t<T>* mean, const acc_t<T>* var, const acc_t<T>* sum_dy,
                 const acc_t<T>* sum_dyxhat, const acc_t<T>* dmean, const acc_t<T>* dvar, T* dx, T* dres,
                 double eps, bool train, int64_t count) {
  using A = acc_t<T>;
  const int64_t L = v.elements_per_group(), C = v.channels;
  std::vector<Coef<A>> coef(C);
  for (int64_t g = 0; g < v.groups; ++g) {
    const int64_t p = g * C;
    for (int64_t c = 0; c < C; ++c)
      coef[c] = backward_coef<A>(scale[p + c], mean[p + c], var[p + c], A(eps), sum_dy[p + c],
                                 sum_dyxhat[p + c], dmean[p + c], dvar[p + c], static_cast<A>(count), train);
    const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
    for (int64_t e = 0; e < L; ++e) {
      const int64_t i = g * L + e;
      const Coef<A>& k = coef[e % C];
      const bool pass = !mg || bit(mg, e);
      const T g_t = pass ? dy[i] : from_float<T>(A(0));
      const A gd = pass ? static_cast<A>(to_float(dy[i])) : A(0);
      dx[i] = from_float<T>(k.a * gd + k.b * (static_cast<A>(to_float(x[i])) - k.shift) + k.c);
      if (dres) dres[i] = g_t;
    }
  }
}

template <class F>
void dispatch(Dtype d, F&& f) {
  cpu::dispatch_float(d, f);
}

}  // namespace

void stats_cpu(const View& v, const void* x, void* mean, void* var) {
  dispatch(v.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    stats<T>(v, static_cast<const T*>(x), static_cast<A*>(mean), static_cast<A*>(var));
  });
}

void apply_cpu(const View& v, const void* x, const void* scale, const void* bias, const void* mean,
               const void* var, const void* residual, void* y, uint32_t* mask, double eps, bool relu) {
  dispatch(v.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    apply<T>(v, static_cast<const T*>(x), static_cast<const A*>(scale), static_cast<const A*>(bias),
             static_cast<const A*>(mean), static_cast<const A*>(var), static_cast<const T*>(residual),
             static_cast<T*>(y), mask, eps, relu);
  });
}

void backward_reduce_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                         const void* mean, const void* var, void* sum_dy, void* sum_dyxhat, double eps) {
  dispatch(v.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    backward_reduce<T>(v, static_cast<const T*>(dy), static_cast<const T*>(x), mask,
                       static_cast<const A*>(mean), static_cast<const A*>(var), static_cast<A*>(sum_dy),
                       static_cast<A*>(sum_dyxhat), eps);
  });
}

void backward_dx_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                     const void* scale, const void* mean, const void* var, const void* sum_dy,
                     const void* sum_dyxhat, const void* dmean, const void* dvar, void* dx, void* dres,
                     double eps, bool train, int64_t count) {
  dispatch(v.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    backward_dx<T>(v, static_cast<const T*>(dy), static_cast<const T*>(x), mask,
                   static_cast<const A*>(scale), static_cast<const A*>(mean), static_cast<const A*>(var),
                   static_cast<const A*>(sum_dy), static_cast<const A*>(sum_dyxhat),
                   static_cast<const A*>(dmean), static_cast<const A*>(dvar), static_cast<T*>(dx),
                   static_cast<T*>(dres), eps, train, count);
  });
}

}  // namespace jaxops::batch_norm
