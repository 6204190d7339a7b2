// Sums, extrema and exp over rows for the CPU twins, in explicit vectors of W floats (cpu_vec.h):
// 16 independent lanes instead of one dependent chain, in the same order for W = 4 and 8.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/cpu_bits.h"
#include "common/cpu_rows.h"
#include "common/cpu_vec.h"

namespace jaxops::cpu {

// Sum of m <= kSumBlock elements: 16 lanes of A, each summing at most 64 of them in order (the
// pairwise leaf the reductions used before), folded as a tree. The same order for every W.
constexpr int64_t kSumBlock = 1024;
constexpr int kLanes = 16;

// lane[0] = merge of lane[0, N) as a tree: lane[j] with lane[j + N/2], then N/4, ... (the order
// every W gives the same bits in).
template <int N, class A, class Merge>
inline A tree_fold(A* lane, Merge merge) {
  for (int w = N / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = merge(lane[j], lane[j + w]);
  return lane[0];
}

template <int N, class A>
inline A tree_sum(A* lane) {
  return tree_fold<N>(lane, [](A a, A b) { return a + b; });
}

// One value from a vector's lanes, folded by halves: lane j with lane j + W/2, then j + W/4, ...,
// op(lower half, upper half) at each step, in vectors down to the last pair. tree_fold's tree in
// registers, with no store and reload of the lanes.
template <class Op>
inline float fold_halves(vf2 v, Op op) {
  return op(v[0], v[1]);
}
template <class F, class H, class Op>
inline H fold_half(F v, Op op) {
  H h[2];
  std::memcpy(h, &v, sizeof v);
  return op(h[0], h[1]);
}
template <class Op>
inline float fold_halves(vf4 v, Op op) {
  return fold_halves(fold_half<vf4, vf2>(v, op), op);
}
template <class Op>
inline float fold_halves(vf8 v, Op op) {
  return fold_halves(fold_half<vf8, vf4>(v, op), op);
}
template <class Op>
inline float fold_halves(vf16 v, Op op) {
  return fold_halves(fold_half<vf16, vf8>(v, op), op);
}

// The sum of 16 lanes held in vectors of W (acc[k] holds lanes [k W, k W + W)) as tree_sum's tree:
// lane j plus lane j + 8, then j + 4, ..., the same additions in the same order, so the same bits.
template <int W>
inline float tree_sum_vectors(typename Vec<W>::F* acc) {
  for (int w = kLanes / W / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return fold_halves(acc[0], [](auto lo, auto hi) { return lo + hi; });
}

// Whether x replaces run in a max (kMax) or min that propagates NaN like jnp.max: x beats run or
// is NaN (a NaN run is then never replaced).
template <bool kMax, class A>
inline bool beats(A x, A run) {
  return (kMax ? x > run : x < run) | (x != x);
}
// Sum of the m <= kSumBlock terms t(i), i in [0, m), in the lanes and order above: vec_at(i) gives
// the W float terms from i (float A only), at(i) one term.
template <int W, class A, class VecAt, class At>
inline A block_sum_of(int64_t m, VecAt vec_at, At at) {
  A lane[kLanes] = {};
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    using V = Vec<W>;
    typename V::F acc[kLanes / W];
    for (auto& a : acc) a = V::splat(0.0f);
    for (; i + kLanes <= m; i += kLanes)
      for (int k = 0; k < kLanes / W; ++k) acc[k] += vec_at(i + k * W);
    // A rest of whole vectors stays in vectors, the lanes summed by halves (tree_sum_vectors: the
    // same bits): through memory, the lanes and tree_sum's scalar reloads were ~5 ns of a
    // 16-element row's 9 (session 75). A partial vector keeps the scalar tail: padding it through
    // memory stalled on store forwarding and lost more than it saved.
    if ((m - i) % W == 0) {
      for (int k = 0; i + k * W < m; ++k) acc[k] += vec_at(i + k * W);
      return tree_sum_vectors<W>(acc);
    }
    for (int k = 0; k < kLanes / W; ++k) V::store(lane + k * W, acc[k]);
  } else {
    for (; i + kLanes <= m; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += at(i + j);
  }
  for (int j = 0; i + j < m; ++j) lane[j] += at(i + j);
  return tree_sum<kLanes>(lane);
}

// Rows of any storage type T are read in place: float states load through load_floats (no
// scratch copy of 16-bit rows first, session 54).
template <int W, class T, class A = acc_t<T>>
inline A block_sum(const T* v, int64_t m) {
  return block_sum_of<W, A>(
      m, [v](auto i) { return load_floats<W>(v + i); }, [v](auto i) { return static_cast<A>(to_float(v[i])); });
}

// Sum of v[0, n): block_sum of each 1024 elements, the blocks added in double. Keeps float32
// rows accurate to a few ulps at any length.
template <int W, class A>
inline double lane_sum(const A* v, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += kSumBlock)
    total += static_cast<double>(block_sum<W>(v + b, n - b < kSumBlock ? n - b : kSumBlock));
  return total;
}

// Sum of the float terms t(i) over [0, n) in lane_sum's lanes, blocks and order: vec_at(i) the W
// terms from i, at(i) one (rows of float32 / 16-bit types read in place, session 55).
template <int W, class VecAt, class At>
inline double lane_sum_of(int64_t n, VecAt vec_at, At at) {
  double total = 0;
  for (int64_t o = 0; o < n; o += kSumBlock)
    total += static_cast<double>(block_sum_of<W, float>(
        n - o < kSumBlock ? n - o : kSumBlock, [&vec_at, o](auto i) { return vec_at(o + i); },
        [&at, o](auto i) { return at(o + i); }));
  return total;
}

// Sum of a[i] * b[i] over [0, n), in lane_sum's lanes and order (softmax's backward: no row of
// products stored first). Its own block loop: through lane_sum_of's nested lambdas the softmax
// backward ran 12-14 % slower (session 55).
template <int W, class T>
inline double lane_dot(const T* a, const T* b, int64_t n) {
  double total = 0;
  for (int64_t o = 0; o < n; o += kSumBlock) {
    const T *ao = a + o, *bo = b + o;
    total += static_cast<double>(block_sum_of<W, float>(
        n - o < kSumBlock ? n - o : kSumBlock, [=](auto i) { return load_floats<W>(ao + i) * load_floats<W>(bo + i); },
        [=](auto i) { return to_float(ao[i]) * to_float(bo[i]); }));
  }
  return total;
}

// W storage values from p as floats, `fill` past the n < W that exist (a row's partial last vector).
template <int W, class T>
inline typename Vec<W>::F load_floats_partial(const T* p, int64_t n, float fill) {
  float pad[W];
  for (int j = 0; j < W; ++j) pad[j] = j < n ? to_float(p[j]) : fill;
  return Vec<W>::load(pad);
}

// Whether any lane of a comparison's mask is set.
template <class I>
inline bool any_lane(I m) {
  uint64_t words[sizeof(I) / 8], any = 0;
  std::memcpy(words, &m, sizeof m);
  for (uint64_t w : words) any |= w;
  return any != 0;
}

// The lowest set lane of a comparison's mask (one that has a set lane), from the lanes' bits
// gathered without a branch a lane.
template <class I>
inline int first_lane(I m) {
  constexpr int kW = sizeof(I) / sizeof(int32_t);
  uint32_t bits = 0;
  for (int j = 0; j < kW; ++j) bits |= (static_cast<uint32_t>(m[j]) & 1u) << j;
  return __builtin_ctz(bits);
}

// The max (kMax) or min of a vector's NaN-free lanes, folded by halves (the lower lane kept on a
// tie) in maxps / minps: no scalar compare-and-branch a lane.
template <bool kMax, class F>
inline float fold_better(F v) {
  return fold_halves(v, [](auto lo, auto hi) { return kMax ? (hi > lo ? hi : lo) : (hi < lo ? hi : lo); });
}

// max (kMax) or min of v[0, n) propagating NaN like jnp.max; the identity for n = 0. Rows of
// any storage type, read in place as in block_sum. Float rows stay in vectors to the end: a
// partial last vector is read as the row's last W elements (the overlap changes no extremum), a
// row shorter than W takes half the width, and the lanes fold by halves. Until session 75 the rest
// of a round and the 16 lanes' fold took a scalar compare-and-branch each, ~45 ns a row that
// mispredicted on random data: 59 ns for a 16-element row against the sum's 10, and short-row
// max / min / argmax / logsumexp at 0.1-0.5x XLA (2 cores, 262144x16 .. 16384x256).
template <int W, bool kMax, class T, class A = acc_t<T>>
inline A lane_extremum(const T* v, int64_t n) {
  const A id = kMax ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity();
  if constexpr (std::is_same_v<A, float>) {
    if constexpr (W > 4) {
      if (n < W) return lane_extremum<W / 2, kMax>(v, n);
    }
    using V = Vec<W>;
    // Plain max / min lanes and, apart, whether a NaN was seen: one maxps / minps a vector,
    // at least four independent chains (W = 8 / 16: 32 / 64 elements a round; harness: max of
    // float rows, AVX2 78 -> 69 us).
    constexpr int kAcc = kLanes / W > 4 ? kLanes / W : 4;
    const auto take = [](typename V::F x, typename V::F run) {
      return V::template keep_better<kMax>(x, run);
    };
    typename V::F acc[kAcc];
    for (auto& a : acc) a = V::splat(id);
    typename V::I nan = typename V::I{};
    int64_t i = 0;
    for (; i + kAcc * W <= n; i += kAcc * W) {
      for (int k = 0; k < kAcc; ++k) {
        const typename V::F x = load_floats<W>(v + i + k * W);
        acc[k] = take(x, acc[k]);
        nan |= V::is_nan(x);
      }
    }
    for (; i + W <= n; i += W) {
      const typename V::F x = load_floats<W>(v + i);
      acc[0] = take(x, acc[0]);
      nan |= V::is_nan(x);
    }
    if (i < n) {  // W = 4 pads a row of 1-3 (through memory: a store-forwarding stall)
      const typename V::F x = n >= W ? load_floats<W>(v + n - W) : load_floats_partial<W>(v, n, id);
      acc[0] = take(x, acc[0]);
      nan |= V::is_nan(x);
    }
    for (int k = 1; k < kAcc; ++k) acc[0] = take(acc[k], acc[0]);
    if (any_lane(nan)) return std::numeric_limits<A>::quiet_NaN();
    return fold_better<kMax>(acc[0]);
  } else {
    A lane[kLanes];
    for (int j = 0; j < kLanes; ++j) lane[j] = id;
    const auto pick = [](A run, A x) { return beats<kMax>(x, run) ? x : run; };
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] = pick(lane[j], static_cast<A>(to_float(v[i + j])));
    for (int j = 0; i + j < n; ++j) lane[j] = pick(lane[j], static_cast<A>(to_float(v[i + j])));
    return tree_fold<kLanes>(lane, pick);
  }
}

// out[i] = exp(in[i] - sub): Vec::exp for float (a partial last vector through a padded copy, so
// every element takes the same instructions), libm for double. `in` may be a row of any storage
// type, read in place.
template <int W, class S, class A>
inline void exp_shifted(const S* in, A sub, A* out, int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    using V = Vec<W>;
    int64_t i = 0;
    for (; i + W <= n; i += W) V::store(out + i, V::exp(load_floats<W>(in + i) - sub));
    if (i < n) {
      float pad[W];
      V::store(pad, V::exp(load_floats_partial<W>(in + i, n - i, 0.0f) - sub));
      for (int64_t j = i; j < n; ++j) out[j] = pad[j - i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = std::exp(in[i] - sub);
  }
}

// Sum of exp(in[i] - sub) over m <= kSumBlock elements in block_sum's lanes and order, without
// storing the exps (float: Vec::exp; double: libm). `in`: any storage type, read in place. A
// partial last vector is padded with -inf, whose exp adds +0 to a lane: the bits of adding only
// the elements that exist. Blocks shorter than W take half the width.
template <int W, class S, class A>
inline A block_exp_sum(const S* in, A sub, int64_t m) {
  if constexpr (std::is_same_v<A, float>) {
    if constexpr (W > 4) {  // the same lanes and bits at any W; no padded vector for m >= 4
      if (m < W) return block_exp_sum<W / 2>(in, sub, m);
    }
    using V = Vec<W>;
    typename V::F acc[kLanes / W];
    for (auto& a : acc) a = V::splat(0.0f);
    int64_t i = 0;
    for (; i + kLanes <= m; i += kLanes)
      for (int k = 0; k < kLanes / W; ++k) acc[k] += V::exp(load_floats<W>(in + i + k * W) - sub);
    for (int k = 0; k * W < m - i; ++k) {
      const int64_t rest = m - i - k * W;
      constexpr float kNoTerm = -std::numeric_limits<float>::infinity();  // exp: +0
      const typename V::F x = rest >= W ? load_floats<W>(in + i + k * W)
                                        : load_floats_partial<W>(in + i + k * W, rest, kNoTerm);
      acc[k] += V::exp(x - sub);
    }
    return tree_sum_vectors<W>(acc);
  } else {
    A lane[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= m; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += std::exp(in[i + j] - sub);
    for (int j = 0; i + j < m; ++j) lane[j] += std::exp(in[i + j] - sub);
    return tree_sum<kLanes>(lane);
  }
}

// Sum of exp(v[i] - sub) over [0, n): block_exp_sum of each 1024 elements, the blocks added in
// double; the bits of lane_sum over exp_shifted's output, without storing the exps.
template <int W, class S, class A>
inline double lane_exp_sum(const S* v, A sub, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += kSumBlock)
    total += static_cast<double>(block_exp_sum<W>(v + b, sub, n - b < kSumBlock ? n - b : kSumBlock));
  return total;
}

// Sum over [0, n) of t = (v[i] - shift) - mean, computed in A (for layer_norm: x - x[0] is exact,
// see layer_norm_cpu.cc), or with kSquares of t^2, for the normalizations' statistics: float32
// lanes were not accurate enough there (tests/test_fuzz.py), so the total is a double sum, 16
// double lanes in order folded as a tree. Float rows reach those lanes in float partials of
// kFloatRun terms (t, or t^2 by a fused multiply-add where the ISA has one), each at most kFloatRun
// rounding errors of 2^-24 relative: converting every element to double instead held a row to one
// element a cycle (session 54).
constexpr int kDoubleLanes = 16;
constexpr int kFloatRun = 4;
template <int W, bool kSquares = false, class A>
inline double dsum(const A* v, int64_t n, A shift = A(0), A mean = A(0)) {
  using V = Vec<W>;
  constexpr int kPer = W / 2;  // doubles a vector
  typename V::D acc[kDoubleLanes / kPer];
  for (auto& a : acc) a = typename V::D{};
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    constexpr int64_t kStep = kDoubleLanes * kFloatRun;
    for (; i + kStep <= n; i += kStep)
      for (int k = 0; k < kDoubleLanes / W; ++k) {
        typename V::F part = V::splat(0.0f);
        for (int r = 0; r < kFloatRun; ++r) {
          const typename V::F t = (V::load(v + i + r * kDoubleLanes + k * W) - shift) - mean;
          part += kSquares ? t * t : t;
        }
        typename V::D lo, hi;
        V::to_doubles(part, &lo, &hi);
        acc[2 * k] += lo;
        acc[2 * k + 1] += hi;
      }
  }
  for (; i + kDoubleLanes <= n; i += kDoubleLanes)
    for (int k = 0; k < kDoubleLanes / kPer; ++k) {
      const typename V::D d = V::widen_d(v + i + k * kPer, shift, mean);
      acc[k] += kSquares ? d * d : d;
    }
  double lane[kDoubleLanes];
  for (int k = 0; k < kDoubleLanes / kPer; ++k)
    for (int j = 0; j < kPer; ++j) lane[k * kPer + j] = acc[k][j];
  for (int j = 0; i + j < n; ++j) {
    const double d = static_cast<double>((v[i + j] - shift) - mean);
    lane[j] += kSquares ? d * d : d;
  }
  return tree_sum<kDoubleLanes>(lane);
}

// The first i in [0, n) with v[i] == m, or, for a NaN m, the first NaN; n if none; v of any
// storage type, read in place. Compares a vector at a time (a partial last one read as the row's
// last W, a row shorter than W at half the width) and reads the hit's lane from the mask's bits
// (argmax / argmin of rows: their extremum first, then where it first occurs, which is
// jnp.argmax's lowest index among ties). Scanning the hit's vector an element at a time cost a
// mispredicted branch a row (session 75).
template <int W, class T, class A = acc_t<T>>
inline int64_t first_index_of(const T* v, int64_t n, A m) {
  const bool nan = m != m;
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    if constexpr (W > 4) {
      if (n < W) return first_index_of<W / 2>(v, n, m);
    }
    using V = Vec<W>;
    const typename V::F mv = V::splat(m);
    const auto hits = [&](typename V::F x) { return nan ? V::is_nan(x) : V::eq(x, mv); };
    for (; i + W <= n; i += W)
      if (const typename V::I hit = hits(load_floats<W>(v + i)); any_lane(hit)) return i + first_lane(hit);
    if (i < n && n >= W) {  // the row's last W: the lanes before i held no hit
      if (const typename V::I hit = hits(load_floats<W>(v + n - W)); any_lane(hit)) return n - W + first_lane(hit);
      return n;
    }
  }
  for (; i < n; ++i) {
    const A x = static_cast<A>(to_float(v[i]));
    if (nan ? x != x : x == m) return i;
  }
  return n;
}

// acc[i] = max (kMax) or min of acc[i] and x[i], propagating NaN like jnp.max.
template <bool kMax, class A>
inline void extremum_into(A* acc, const A* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    acc[i] = select_bits(beats<kMax>(x[i], acc[i]), x[i], acc[i]);
}

}  // namespace jaxops::cpu
