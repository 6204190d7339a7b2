#include "batch_norm/bn_cpu.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "batch_norm/bn_math.h"
#include "common/cpu_bits.h"
#include "common/cpu_columns.h"
#include "common/cpu_rows.h"
#include "common/cpu_vec.h"

namespace jaxops::batch_norm {
namespace {

using cpu::acc_t;

// Rows of C channels go through accumulation-type scratch, a pass over the row at a time, so
// the loops vectorize (cpu_rows.h, cpu_bits.h); the relu mask is packed / unpacked 32 bits at a time at the
// row's bit offset. (The old loops took the channel as e % C, a 64-bit division an element.)

// Rows summed in float before their sums join the double per-channel totals: a float partial of
// kStatsRun rows carries at most that many roundings of 2^-24 relative (session 54: converting
// every element to double held the statistics to ~1.4 cycles an element).
constexpr int64_t kStatsRun = 16;

template <int W, class T>
void stats(const View& v, const T* x, acc_t<T>* mean, acc_t<T>* var) {
  const int64_t R = v.rows, C = v.channels;
  std::vector<double> s(C), q(C);
  if constexpr (std::is_same_v<acc_t<T>, float>) {
    // Two passes: the mean, then the sums of d = x - m and d^2 about the float mean m; the
    // mean of d corrects both (var = mean(d^2) - mean(d)^2), so m's rounding costs nothing.
    std::vector<float> m(C), part(C), part2(C);
    std::vector<double> sd(C);
    for (int64_t g = 0; g < v.groups; ++g) {
      const T* xg = x + g * R * C;
      std::fill(s.begin(), s.end(), 0.0);
      for (int64_t r0 = 0; r0 < R; r0 += kStatsRun) {
        std::fill(part.begin(), part.end(), 0.0f);
        cpu::column_leaf<W, true, true>(xg + r0 * C, std::min(kStatsRun, R - r0), C, part.data());
        for (int64_t c = 0; c < C; ++c) s[c] += static_cast<double>(part[c]);
      }
      for (int64_t c = 0; c < C; ++c) m[c] = static_cast<float>(s[c] / static_cast<double>(R));
      std::fill(sd.begin(), sd.end(), 0.0);
      std::fill(q.begin(), q.end(), 0.0);
      for (int64_t r0 = 0; r0 < R; r0 += kStatsRun) {
        std::fill(part.begin(), part.end(), 0.0f);
        std::fill(part2.begin(), part2.end(), 0.0f);
        cpu::centred_sums<W>(xg + r0 * C, std::min(kStatsRun, R - r0), C, m.data(), part.data(), part2.data());
        for (int64_t c = 0; c < C; ++c) sd[c] += static_cast<double>(part[c]), q[c] += static_cast<double>(part2[c]);
      }
      for (int64_t c = 0; c < C; ++c) {
        const double md = sd[c] / static_cast<double>(R);
        // An inf mean stays itself (inf - inf would make the corrected one NaN); var is NaN then.
        mean[g * C + c] = static_cast<float>(std::isfinite(m[c]) ? static_cast<double>(m[c]) + md : s[c] / static_cast<double>(R));
        var[g * C + c] = static_cast<float>(std::max(q[c] / static_cast<double>(R) - md * md, 0.0));
      }
    }
  } else {  // float64: sums in double as they come
    for (int64_t g = 0; g < v.groups; ++g) {
      const T* xg = x + g * R * C;
      std::fill(s.begin(), s.end(), 0.0);
      std::fill(q.begin(), q.end(), 0.0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) s[c] += xg[r * C + c];
      for (int64_t c = 0; c < C; ++c) s[c] /= static_cast<double>(R);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const double d = xg[r * C + c] - s[c];
          q[c] += d * d;
        }
      for (int64_t c = 0; c < C; ++c) {
        mean[g * C + c] = s[c];
        var[g * C + c] = q[c] / static_cast<double>(R);
      }
    }
  }
}

template <class T>
void apply(const View& v, const T* x, const acc_t<T>* scale, const acc_t<T>* bias,
           const acc_t<T>* mean, const acc_t<T>* var, const T* res, T* y, uint32_t* mask, double eps,
           bool relu) {
  using A = acc_t<T>;
  const int64_t R = v.rows, C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> shift(C), ka(C), kb(C), z(C), rr(res && !kInPlace ? C : 0);
  std::vector<int32_t> pos(C);
  for (int64_t g = 0; g < v.groups; ++g) {
    const int64_t p = g * C;
    for (int64_t c = 0; c < C; ++c) {
      const Coef<A> k = forward_coef<A>(scale[p + c], bias[p + c], mean[p + c], var[p + c], A(eps));
      shift[c] = k.shift, ka[c] = k.a, kb[c] = k.b;
    }
    uint32_t* mg = v.mask_words ? mask + g * v.mask_words : nullptr;
    if (mg) std::fill(mg, mg + v.mask_words, 0u);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i0 = g * L + r * C;
      // float / double rows are read and written in place; 16-bit ones through z (and rr).
      const A* xr = cpu::acc_row(x + i0, z.data(), C);
      const A* rv = res ? cpu::acc_row(res + i0, rr.data(), C) : nullptr;
      A* out = cpu::acc_out(y + i0, z.data());
      for (int64_t c = 0; c < C; ++c) {
        A t = (xr[c] - shift[c]) * ka[c] + kb[c];
        if (res) t += rv[c];
        if (relu) {
          pos[c] = t > A(0);
          t = cpu::keep_if(t, (t > A(0)) | (t != t));  // NaN propagates like jax.nn.relu
        }
        out[c] = t;
      }
      if (relu && mg) cpu::pack_bits(pos.data(), C, mg, r * C);
      cpu::narrow_row(z.data(), y + i0, C);
    }
  }
}

template <class T>
void backward_reduce(const View& v, const T* dy, const T* x, const uint32_t* mask,
                     const acc_t<T>* mean, const acc_t<T>* var, acc_t<T>* sum_dy,
                     acc_t<T>* sum_dyxhat, double eps) {
  using A = acc_t<T>;
  const int64_t R = v.rows, C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<double> s(C), q(C);
  std::vector<A> gw(kInPlace ? 0 : C), xw(kInPlace ? 0 : C), ps(C), pq(C);
  std::vector<int32_t> pass(C, -1);
  for (int64_t g = 0; g < v.groups; ++g) {
    std::fill(s.begin(), s.end(), 0.0);
    std::fill(q.begin(), q.end(), 0.0);
    const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
    const A* mu = mean + g * C;
    // Runs of kStatsRun rows summed in A (float), then added to the double sums, as in stats.
    for (int64_t r0 = 0; r0 < R; r0 += kStatsRun) {
      std::fill(ps.begin(), ps.end(), A(0));
      std::fill(pq.begin(), pq.end(), A(0));
      for (int64_t r = r0; r < std::min(R, r0 + kStatsRun); ++r) {
        const int64_t i0 = g * L + r * C;
        const A* gv = cpu::acc_row(dy + i0, gw.data(), C);
        const A* xv = cpu::acc_row(x + i0, xw.data(), C);
        if (mg) cpu::unpack_bits(mg, r * C, C, pass.data());
        // Masked-out elements take no part at all (a NaN dy or an inf x there adds nothing).
        for (int64_t c = 0; c < C; ++c) {
          const A d = cpu::keep_if(gv[c], pass[c] != 0);
          ps[c] += d;
          pq[c] += cpu::keep_if(d * (xv[c] - mu[c]), pass[c] != 0);
        }
      }
      for (int64_t c = 0; c < C; ++c) s[c] += static_cast<double>(ps[c]), q[c] += static_cast<double>(pq[c]);
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
  using R = typename cpu::Raw<T>::type;
  const int64_t rows = v.rows, C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> shift(C), ka(C), kb(C), kc(C), gw(kInPlace ? 0 : C), xw(C);
  std::vector<int32_t> pass(C, -1);
  for (int64_t g = 0; g < v.groups; ++g) {
    const int64_t p = g * C;
    for (int64_t c = 0; c < C; ++c) {
      const Coef<A> k = backward_coef<A>(scale[p + c], mean[p + c], var[p + c], A(eps), sum_dy[p + c],
                                         sum_dyxhat[p + c], dmean[p + c], dvar[p + c], static_cast<A>(count), train);
      shift[c] = k.shift, ka[c] = k.a, kb[c] = k.b, kc[c] = k.c;
    }
    const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i0 = g * L + r * C;
      // float / double rows are read and written in place; 16-bit ones through gw and xw.
      const A* gv = cpu::acc_row(dy + i0, gw.data(), C);
      const A* xv = cpu::acc_row(x + i0, xw.data(), C);
      A* out = cpu::acc_out(dx + i0, xw.data());
      if (mg) cpu::unpack_bits(mg, r * C, C, pass.data());
      for (int64_t c = 0; c < C; ++c)  // a masked NaN dy gives 0
        out[c] = ka[c] * cpu::keep_if(gv[c], pass[c] != 0) + kb[c] * (xv[c] - shift[c]) + kc[c];
      cpu::narrow_row(xw.data(), dx + i0, C);
      if (dres) {  // dy' itself: dy's bits where the mask passes, else +0
        const R* d = reinterpret_cast<const R*>(dy + i0);
        R* o = reinterpret_cast<R*>(dres + i0);
        for (int64_t c = 0; c < C; ++c) o[c] = d[c] & cpu::ones_if<R>(pass[c] != 0);
      }
    }
  }
}

// f(W, T{}) for the storage type T of d, in cpu::run_isa's clone for the CPU (the loops above
// are auto-vectorized: in the AVX2+FMA clone they get 32-byte vectors; W sizes the explicit ones).
template <class F>
void dispatch(Dtype d, F&& f) {
  cpu::run_isa<8>([&](auto w) { return cpu::dispatch_float(d, [&](auto tag) { f(w, tag); }); });
}

}  // namespace

void stats_cpu(const View& v, const void* x, void* mean, void* var) {
  dispatch(v.dtype, [&](auto w, auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    stats<w.value, T>(v, static_cast<const T*>(x), static_cast<A*>(mean), static_cast<A*>(var));
  });
}

void apply_cpu(const View& v, const void* x, const void* scale, const void* bias, const void* mean,
               const void* var, const void* residual, void* y, uint32_t* mask, double eps, bool relu) {
  dispatch(v.dtype, [&](auto, auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    apply<T>(v, static_cast<const T*>(x), static_cast<const A*>(scale), static_cast<const A*>(bias),
             static_cast<const A*>(mean), static_cast<const A*>(var), static_cast<const T*>(residual),
             static_cast<T*>(y), mask, eps, relu);
  });
}

void backward_reduce_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                         const void* mean, const void* var, void* sum_dy, void* sum_dyxhat, double eps) {
  dispatch(v.dtype, [&](auto, auto tag) {
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
  dispatch(v.dtype, [&](auto, auto tag) {
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
