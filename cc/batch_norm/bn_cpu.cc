#include "batch_norm/bn_cpu.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "batch_norm/bn_math.h"
#include "common/cpu_bits.h"
#include "common/cpu_columns.h"
#include "common/cpu_parts.h"
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

// The statistics' sums over rows [r0, r1) of group g, into s (C doubles, zeroed first): of x
// (pass 1), or, with the group's mean m, of d = x - m and d^2 (pass 2, sd and q).
template <int W, class T>
void stats_sums(const View& v, const T* x, int64_t g, int64_t r0, int64_t r1, double* s) {
  const int64_t C = v.channels;
  const T* xg = x + g * v.rows * C;
  std::fill(s, s + C, 0.0);
  if constexpr (std::is_same_v<acc_t<T>, float>) {
    std::vector<float> part(C);
    for (int64_t r = r0; r < r1; r += kStatsRun) {
      std::fill(part.begin(), part.end(), 0.0f);
      cpu::column_leaf<W, true, true>(xg + r * C, std::min(kStatsRun, r1 - r), C, part.data());
      for (int64_t c = 0; c < C; ++c) s[c] += static_cast<double>(part[c]);
    }
  } else {  // float64: sums in double as they come
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < C; ++c) s[c] += xg[r * C + c];
  }
}

template <int W, class T>
void stats_centred(const View& v, const T* x, int64_t g, int64_t r0, int64_t r1, const acc_t<T>* m, double* sd,
                   double* q) {
  const int64_t C = v.channels;
  const T* xg = x + g * v.rows * C;
  std::fill(sd, sd + C, 0.0);
  std::fill(q, q + C, 0.0);
  if constexpr (std::is_same_v<acc_t<T>, float>) {
    std::vector<float> part(C), part2(C);
    for (int64_t r = r0; r < r1; r += kStatsRun) {
      std::fill(part.begin(), part.end(), 0.0f);
      std::fill(part2.begin(), part2.end(), 0.0f);
      cpu::centred_sums<W>(xg + r * C, std::min(kStatsRun, r1 - r), C, m, part.data(), part2.data());
      for (int64_t c = 0; c < C; ++c) sd[c] += static_cast<double>(part[c]), q[c] += static_cast<double>(part2[c]);
    }
  } else {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const double d = xg[r * C + c] - m[c];
        q[c] += d * d;
      }
  }
}

// The sum over the `parts` pieces of group g of piece sums (C doubles each, in piece order).
inline double part_total(const double* sums, int64_t parts, int64_t g, int64_t C, int64_t c) {
  double t = 0.0;
  for (int64_t p = 0; p < parts; ++p) t += sums[(g * parts + p) * C + c];
  return t;
}

template <class T>
void apply(const View& v, const T* x, const acc_t<T>* scale, const acc_t<T>* bias,
           const acc_t<T>* mean, const acc_t<T>* var, const T* res, T* y, uint32_t* mask, double eps,
           bool relu, const RowBlocks& b, int64_t u0, int64_t u1) {
  using A = acc_t<T>;
  const int64_t R = v.rows, C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> shift(C), ka(C), kb(C), z(C), rr(res && !kInPlace ? C : 0);
  std::vector<int32_t> pos(C);
  int64_t group = -1;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t g = u / b.per_group, r0 = u % b.per_group * b.rows, r1 = std::min(R, r0 + b.rows);
    const int64_t p = g * C;
    if (g != group) {
      group = g;
      for (int64_t c = 0; c < C; ++c) {
        const Coef<A> k = forward_coef<A>(scale[p + c], bias[p + c], mean[p + c], var[p + c], A(eps));
        shift[c] = k.shift, ka[c] = k.a, kb[c] = k.b;
      }
    }
    uint32_t* mg = v.mask_words ? mask + g * v.mask_words : nullptr;
    // The block's own mask words: r0 C is a multiple of 32 (RowBlocks), and the group's last
    // block owns the group's last words.
    if (mg) std::fill(mg + r0 * C / 32, r1 == R ? mg + v.mask_words : mg + r1 * C / 32, 0u);
    for (int64_t r = r0; r < r1; ++r) {
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

// backward_reduce's sums over rows [r0, r1) of group g, into s and q (C doubles each).
template <class T>
void backward_sums(const View& v, const T* dy, const T* x, const uint32_t* mask, const acc_t<T>* mean, int64_t g,
                   int64_t r0, int64_t r1, double* s, double* q) {
  using A = acc_t<T>;
  const int64_t C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> gw(kInPlace ? 0 : C), xw(kInPlace ? 0 : C), ps(C), pq(C);
  std::vector<int32_t> pass(C, -1);
  std::fill(s, s + C, 0.0);
  std::fill(q, q + C, 0.0);
  const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
  const A* mu = mean + g * C;
  // Runs of kStatsRun rows summed in A (float), then added to the double sums, as in stats.
  for (int64_t rr = r0; rr < r1; rr += kStatsRun) {
    std::fill(ps.begin(), ps.end(), A(0));
    std::fill(pq.begin(), pq.end(), A(0));
    for (int64_t r = rr; r < std::min(r1, rr + kStatsRun); ++r) {
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
}

template <class T>
void backward_dx(const View& v, const T* dy, const T* x, const uint32_t* mask, const acc_t<T>* scale,
                 const acc_t<T>* mean, const acc_t<T>* var, const acc_t<T>* sum_dy,
                 const acc_t<T>* sum_dyxhat, const acc_t<T>* dmean, const acc_t<T>* dvar, T* dx, T* dres,
                 double eps, bool train, int64_t count, const RowBlocks& b, int64_t u0, int64_t u1) {
  using A = acc_t<T>;
  using R = typename cpu::Raw<T>::type;
  const int64_t C = v.channels, L = v.elements_per_group();
  constexpr bool kInPlace = std::is_same_v<T, A>;
  std::vector<A> shift(C), ka(C), kb(C), kc(C), gw(kInPlace ? 0 : C), xw(C);
  std::vector<int32_t> pass(C, -1);
  int64_t group = -1;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t g = u / b.per_group, r0 = u % b.per_group * b.rows, r1 = std::min(v.rows, r0 + b.rows);
    const int64_t p = g * C;
    if (g != group) {
      group = g;
      for (int64_t c = 0; c < C; ++c) {
        const Coef<A> k = backward_coef<A>(scale[p + c], mean[p + c], var[p + c], A(eps), sum_dy[p + c],
                                           sum_dyxhat[p + c], dmean[p + c], dvar[p + c], static_cast<A>(count), train);
        shift[c] = k.shift, ka[c] = k.a, kb[c] = k.b, kc[c] = k.c;
      }
    }
    const uint32_t* mg = mask ? mask + g * v.mask_words : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
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

// The row ranges of each group's sums (the shape alone decides them).
int64_t stat_parts(const View& v) { return cpu::row_parts(v.groups, v.rows, v.channels, kStatsRun); }

}  // namespace

// for_ranges runs outside dispatch and each range enters the ISA clone itself: a lambda called
// through for_ranges is a function of its own, compiled for the baseline target, not the clone's.
void stats_cpu(const View& v, const void* x, void* mean, void* var, const ForRanges& for_ranges) {
  const int64_t C = v.channels, R = v.rows, parts = stat_parts(v), pieces = v.groups * parts;
  const double rows = static_cast<double>(R);
  std::vector<double> s(pieces * C), sd(pieces * C), q(pieces * C), mean_d(v.groups * C);
  std::vector<float> mean_f(v.groups * C);  // the float mean that float32 / 16-bit rows are centred on
  // Pass 1: the sums, piece by piece; the group means from them in piece order.
  for_ranges(pieces, R / parts * C, [&](int64_t i0, int64_t i1) {
    dispatch(v.dtype, [&](auto w, auto tag) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t r0, r1;
        cpu::part_rows(R, parts, i % parts, &r0, &r1);
        stats_sums<w.value>(v, static_cast<const decltype(tag)*>(x), i / parts, r0, r1, &s[i * C]);
      }
    });
  });
  for (int64_t o = 0; o < v.groups * C; ++o) {
    mean_d[o] = part_total(s.data(), parts, o / C, C, o % C) / rows;
    mean_f[o] = static_cast<float>(mean_d[o]);
  }
  // Pass 2: the centred sums about those means.
  for_ranges(pieces, R / parts * C, [&](int64_t i0, int64_t i1) {
    dispatch(v.dtype, [&](auto w, auto tag) {
      using T = decltype(tag);
      const acc_t<T>* m;
      if constexpr (std::is_same_v<acc_t<T>, float>) m = mean_f.data();
      else m = mean_d.data();
      for (int64_t i = i0; i < i1; ++i) {
        int64_t r0, r1;
        cpu::part_rows(R, parts, i % parts, &r0, &r1);
        stats_centred<w.value>(v, static_cast<const T*>(x), i / parts, r0, r1, m + i / parts * C, &sd[i * C],
                               &q[i * C]);
      }
    });
  });
  for (int64_t o = 0; o < v.groups * C; ++o) {
    const int64_t g = o / C, c = o % C;
    const double qt = part_total(q.data(), parts, g, C, c);
    if (v.f64) {
      static_cast<double*>(mean)[o] = mean_d[o];
      static_cast<double*>(var)[o] = qt / rows;
    } else {
      // var = mean(d^2) - mean(d)^2 about the float mean m: the mean of d corrects both, so m's
      // rounding costs nothing. An inf mean stays itself (inf - inf would make the corrected one
      // NaN); var is NaN then.
      const double md = part_total(sd.data(), parts, g, C, c) / rows;
      const float m = mean_f[o];
      static_cast<float*>(mean)[o] = static_cast<float>(std::isfinite(m) ? static_cast<double>(m) + md : mean_d[o]);
      static_cast<float*>(var)[o] = static_cast<float>(std::max(qt / rows - md * md, 0.0));
    }
  }
}

RowBlocks row_blocks(const View& v, int64_t min_rows) {
  const int64_t align = 32 / std::gcd<int64_t>(v.channels, 32);  // rows C a multiple of 32: whole mask words
  const int64_t want = (std::max<int64_t>(min_rows, 1) + align - 1) / align * align;
  const int64_t rows = std::min(std::max<int64_t>(v.rows, 1), want);
  return RowBlocks{rows, (v.rows + rows - 1) / rows};
}

void apply_cpu(const View& v, const void* x, const void* scale, const void* bias, const void* mean,
               const void* var, const void* residual, void* y, uint32_t* mask, double eps, bool relu,
               const RowBlocks& b, int64_t u0, int64_t u1) {
  dispatch(v.dtype, [&](auto, auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    apply<T>(v, static_cast<const T*>(x), static_cast<const A*>(scale), static_cast<const A*>(bias),
             static_cast<const A*>(mean), static_cast<const A*>(var), static_cast<const T*>(residual),
             static_cast<T*>(y), mask, eps, relu, b, u0, u1);
  });
}

void backward_reduce_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                         const void* mean, const void* var, void* sum_dy, void* sum_dyxhat, double eps,
                         const ForRanges& for_ranges) {
  const int64_t C = v.channels, R = v.rows, parts = stat_parts(v), pieces = v.groups * parts;
  std::vector<double> s(pieces * C), q(pieces * C);
  for_ranges(pieces, R / parts * C, [&](int64_t i0, int64_t i1) {  // (dispatch inside: see stats_cpu)
    dispatch(v.dtype, [&](auto, auto tag) {
      using T = decltype(tag);
      for (int64_t i = i0; i < i1; ++i) {
        int64_t r0, r1;
        cpu::part_rows(R, parts, i % parts, &r0, &r1);
        backward_sums<T>(v, static_cast<const T*>(dy), static_cast<const T*>(x), mask,
                         static_cast<const acc_t<T>*>(mean), i / parts, r0, r1, &s[i * C], &q[i * C]);
      }
    });
  });
  const auto store = [&](auto* sdy, auto* sdx, const auto* va) {
    using A = std::remove_reference_t<decltype(*sdy)>;
    for (int64_t o = 0; o < v.groups * C; ++o) {
      sdy[o] = static_cast<A>(part_total(s.data(), parts, o / C, C, o % C));
      sdx[o] = static_cast<A>(part_total(q.data(), parts, o / C, C, o % C)) * inv_std<A>(va[o], A(eps));
    }
  };
  if (v.f64) store(static_cast<double*>(sum_dy), static_cast<double*>(sum_dyxhat), static_cast<const double*>(var));
  else store(static_cast<float*>(sum_dy), static_cast<float*>(sum_dyxhat), static_cast<const float*>(var));
}

void backward_dx_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                     const void* scale, const void* mean, const void* var, const void* sum_dy,
                     const void* sum_dyxhat, const void* dmean, const void* dvar, void* dx, void* dres,
                     double eps, bool train, int64_t count, const RowBlocks& b, int64_t u0, int64_t u1) {
  dispatch(v.dtype, [&](auto, auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    backward_dx<T>(v, static_cast<const T*>(dy), static_cast<const T*>(x), mask,
                   static_cast<const A*>(scale), static_cast<const A*>(mean), static_cast<const A*>(var),
                   static_cast<const A*>(sum_dy), static_cast<const A*>(sum_dyxhat),
                   static_cast<const A*>(dmean), static_cast<const A*>(dvar), static_cast<T*>(dx),
                   static_cast<T*>(dres), eps, train, count, b, u0, u1);
  });
}

}  // namespace jaxops::batch_norm
