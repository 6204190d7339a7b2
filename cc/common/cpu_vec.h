// Inner loops of the CPU twins, written so that GCC and Clang vectorize them: rows are widened
// into float (double for float64) scratch, computed there, and narrowed back; selects are integer
// masks, not branches (the compiler turns `c ? a : b` and `&&` into branches, which stop the
// vectorizer); mask bits come from a table (SSE2 has no per-lane variable shift); sums run in 16
// independent lanes; exp is a polynomial. Each entry point runs through run_isa: the baseline
// x86-64 ISA (SSE2, 4-float vectors) everywhere, an AVX2+FMA clone (8-float vectors) where the
// CPU has it. Session 52 (2 AMD EPYC cores, 1M elements): built with -Os (nanobind's default)
// and with libm's exp, branches and a 64-bit division an element, the twins ran 10-40x slower
// than XLA's own CPU code.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/cpu_float.h"

namespace jaxops::cpu {

// A storage type's bits as a signed integer of its width (may_alias: the buffers hold T).
template <class T> struct Raw;
template <> struct Raw<float> {
  typedef int32_t __attribute__((may_alias)) type;
  static constexpr int32_t kInf = 0x7f800000, kMag = 0x7fffffff;
};
template <> struct Raw<double> {
  typedef int64_t __attribute__((may_alias)) type;
  static constexpr int64_t kInf = 0x7ff0000000000000, kMag = 0x7fffffffffffffff;
};
template <> struct Raw<bf16> {
  typedef int16_t __attribute__((may_alias)) type;
  static constexpr int16_t kInf = 0x7f80, kMag = 0x7fff;
};
template <> struct Raw<f16> {
  typedef int16_t __attribute__((may_alias)) type;
  static constexpr int16_t kInf = 0x7c00, kMag = 0x7fff;
};

// All ones where `c`, else 0: the vectorizable form of a select's condition.
template <class I>
inline I ones_if(bool c) {
  return static_cast<I>(-static_cast<I>(c));
}

// a where `take`, else b (bits), for the vectorizer.
template <class A>
inline A select_bits(bool take, A a, A b) {
  using I = std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>;
  I ia, ib;
  std::memcpy(&ia, &a, sizeof ia);
  std::memcpy(&ib, &b, sizeof ib);
  const I m = ones_if<I>(take);
  const I r = (ia & m) | (ib & ~m);
  std::memcpy(&a, &r, sizeof a);
  return a;
}

// v where `keep`, else +0 (all bits 0).
template <class A>
inline A keep_if(A v, bool keep) {
  return select_bits(keep, v, A(0));
}

// v[i] = fill where keep[i] is false (a jax `where` mask of bools, read as bytes: the vectorizer
// has no vector type for bool).
template <class A>
inline void fill_unkept(const bool* keep, A* v, A fill, int64_t n) {
  const uint8_t* k = reinterpret_cast<const uint8_t*>(keep);
  for (int64_t i = 0; i < n; ++i) v[i] = select_bits(k[i] != 0, v[i], fill);
}

// acc[i] = max (kMax) or min of acc[i] and x[i], propagating NaN like jnp.max.
template <bool kMax, class A>
inline void extremum_into(A* acc, const A* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    acc[i] = select_bits((kMax ? x[i] > acc[i] : x[i] < acc[i]) | (x[i] != x[i]), x[i], acc[i]);
}

// Bit j of a 32-bit mask word.
alignas(64) inline constexpr uint32_t kBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// W floats (GCC/Clang vector extensions): W = 4 is the SSE2 register every x86-64 has; W = 8
// runs in AVX2+FMA clones of the entry points (run_isa). The loops below use them directly because
// the auto-vectorizer scalarized the lane arrays of the NaN-propagating max (session 52: 1.2 ns
// an element, against 0.07 for the sum it did vectorize). Code with W = 8 is only ever inlined
// into such a clone: outside one, GCC lowered 32-byte compares and selects to scalar branches.
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef double vd2 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef double vd4 __attribute__((vector_size(32)));
template <int W> struct VecTypes;  // (GCC drops vector_size on a typedef whose size is dependent)
template <> struct VecTypes<4> {
  using F = vf4;
  using I = vi4;
  using D = vd2;
};
template <> struct VecTypes<8> {
  using F = vf8;
  using I = vi8;
  using D = vd4;
};

template <int W>
struct Vec {
  using F = typename VecTypes<W>::F;  // W floats
  using I = typename VecTypes<W>::I;  // W int32
  using D = typename VecTypes<W>::D;  // W / 2 doubles
  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, F v) { std::memcpy(p, &v, sizeof v); }
  static F splat(float f) { return F{} + f; }
  static I bits(F v) {
    I i;
    std::memcpy(&i, &v, sizeof i);
    return i;
  }
  static F floats(I i) {
    F v;
    std::memcpy(&v, &i, sizeof v);
    return v;
  }
  // a where m (all ones), else b.
  static F select(I m, F a, F b) { return floats((m & bits(a)) | (~m & bits(b))); }
  // W / 2 doubles from as many consecutive A values, centred first in A: (p - shift) - mean.
  template <class A>
  static D widen_d(const A* p, A shift, A mean) {
    D d;
    for (int k = 0; k < W / 2; ++k) d[k] = static_cast<double>((p[k] - shift) - mean);
    return d;
  }

  // exp(d) in float32 for d <= 88 (softmax and logsumexp only take exp(x - max) <= 1): Cody-Waite
  // reduction d = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial (about 1 ulp), scaled
  // by 2^n through the exponent bits. Exact at 0 (exp(0) = 1, as the row maximum needs); d < -87.3
  // gives 0 (no subnormals); NaN stays NaN; -inf gives 0.
  static F exp(F d) {
    d = select(d < splat(-87.5f), splat(-87.5f), d);  // also -inf; a NaN d fails and stays
    d = select(d > splat(88.0f), splat(88.0f), d);
    const F magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const F n = (d * 1.44269504088896341f + magic) - magic;
    const F r = (d - n * 0.693359375f) + n * 2.12194440e-4f;
    F p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // n in [-126, 127]: a normal exponent field. A NaN n (NaN d: p is NaN already) is zeroed
    // first, as converting NaN to an integer is undefined.
    const I ni = __builtin_convertvector(floats(bits(n) & (n == n)), I);
    const F y = p * floats((ni + 127) << 23);
    // 0 for -inf and whatever would round to a subnormal (a NaN d fails the test: kept).
    return floats(bits(y) & ~(d <= splat(-87.3f)));
  }
};

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
// f(std::integral_constant<int, 8>) compiled for AVX2+FMA, everything it calls inlined into it
// (flatten), so no 8-wide code runs outside the clone.
template <class F>
__attribute__((target("avx2,fma"), flatten)) auto run_avx2(F& f) {
  return f(std::integral_constant<int, 8>{});
}
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// JAXOPS_CPU_ISA=baseline keeps every call on the baseline code (W = 4), so that
// tests/test_cpu_isa.py checks both paths on one machine; read per call, like the GPU hooks.
inline bool baseline_forced() {
  const char* isa = std::getenv("JAXOPS_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, "baseline") == 0;
}

// Runs f(std::integral_constant<int, W>): W = 8 in an AVX2+FMA clone where the CPU has them
// (results may differ in the last bits from W = 4's, which has no fused multiply-add), else 4.
template <class F>
auto run_isa(F&& f) {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  if (has_avx2() && !baseline_forced()) return run_avx2(f);
#endif
  return f(std::integral_constant<int, 4>{});
}

// float16 <-> float32 without branches (the conversions of cpu_float.h take one for inf / NaN
// and subnormals, which kept f16 rows scalar: 4x float32's time). Same bits as to_float /
// from_float<f16> for every input (checked exhaustively, session 52): subnormal halves become
// normal floats through one float subtraction, floats round to nearest even through integer
// adds (normal halves) or one float addition (subnormal halves).
inline uint32_t f16_bits_to_f32_bits(uint16_t h) {
  const uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa, moved
  const uint32_t exp = o & (0x7c00u << 13);
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);  // exponent field all ones
  // Subnormal (and zero): 2^-14 * mantissa / 1024, exactly, as (1 + m / 2^10) * 2^-14 - 2^-14.
  uint32_t sub_bits = normal + (1u << 23);
  float sub;
  std::memcpy(&sub, &sub_bits, 4);
  sub -= 6.103515625e-05f;  // 2^-14
  std::memcpy(&sub_bits, &sub, 4);
  const uint32_t is_inf_nan = ones_if<uint32_t>(exp == (0x7c00u << 13));
  const uint32_t is_sub = ones_if<uint32_t>(exp == 0);
  const uint32_t mag = (inf_nan & is_inf_nan) | (sub_bits & is_sub) | (normal & ~(is_inf_nan | is_sub));
  return mag | (static_cast<uint32_t>(h & 0x8000u) << 16);
}

inline uint16_t f32_to_f16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u ^ sign;
  // >= 65520 rounds to inf; NaN becomes the quiet NaN 0x7e00 (with the sign), as from_float does.
  const uint32_t big = static_cast<uint32_t>(static_cast<int32_t>(a) > 0x7f800000 ? 0x7e00u : 0x7c00u);
  // Subnormal halves (|v| < 2^-14): adding 0.5 moves the value's bits 2^-24 and up into the low
  // mantissa bits, rounded to nearest even by the float addition itself.
  float af;
  std::memcpy(&af, &a, 4);
  float sf = af + 0.5f;
  uint32_t sb;
  std::memcpy(&sb, &sf, 4);
  const uint32_t sub = sb - 0x3f000000u;  // minus the bits of 0.5
  // Normal halves: rebias the exponent, round the 13 dropped bits to nearest even.
  const uint32_t normal = (a + ((15u - 127u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t is_big = ones_if<uint32_t>(static_cast<int32_t>(a) >= 0x477ff000);
  const uint32_t is_sub = ones_if<uint32_t>(static_cast<int32_t>(a) < 0x38800000);
  const uint32_t mag = (big & is_big) | (sub & is_sub & ~is_big) | (normal & ~(is_big | is_sub));
  return static_cast<uint16_t>(mag | (sign >> 16));
}

// Storage row -> accumulation-type row (float; double for float64).
template <class T, class A>
inline void widen(const T* src, A* dst, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
  } else if constexpr (std::is_same_v<T, f16> && std::is_same_v<A, float>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = f16_bits_to_f32_bits(s[i]);
      std::memcpy(dst + i, &u, 4);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(to_float(src[i]));
  }
}

// Accumulation-type row -> storage row, rounding to nearest even (bf16: NaN stays a quiet NaN,
// the bits from_float<bf16> gives, without its branch).
template <class T, class A>
inline void narrow(const A* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, src + i, 4);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const uint32_t nan = ones_if<uint32_t>(static_cast<int32_t>(u & 0x7fffffffu) > 0x7f800000);
      d[i] = static_cast<uint16_t>((((u >> 16) | 0x40u) & nan) | (rounded & ~nan));
    }
  } else if constexpr (std::is_same_v<T, f16> && std::is_same_v<A, float>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_bits(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
  }
}

// Sum of m <= kSumBlock elements: 16 lanes of A, each summing at most 64 of them in order (the
// pairwise leaf the reductions used before), folded as a tree. The same order for every W.
constexpr int64_t kSumBlock = 1024;
constexpr int kLanes = 16;
template <int W, class A>
inline A block_sum(const A* v, int64_t m) {
  using V = Vec<W>;
  A lane[kLanes] = {};
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    typename V::F acc[kLanes / W];
    for (auto& a : acc) a = V::splat(0.0f);
    for (; i + kLanes <= m; i += kLanes)
      for (int k = 0; k < kLanes / W; ++k) acc[k] += V::load(v + i + k * W);
    for (int k = 0; k < kLanes / W; ++k) V::store(lane + k * W, acc[k]);
  } else {
    for (; i + kLanes <= m; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += v[i + j];
  }
  for (int j = 0; i + j < m; ++j) lane[j] += v[i + j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
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

// max (kMax) or min of v[0, n) propagating NaN like jnp.max; the identity for n = 0.
template <int W, bool kMax, class A>
inline A lane_extremum(const A* v, int64_t n) {
  using V = Vec<W>;
  const A id = kMax ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity();
  A lane[kLanes];
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    // Plain max / min lanes and, apart, whether a NaN was seen: one compare and select a vector.
    typename V::F acc[kLanes / W];
    for (auto& a : acc) a = V::splat(id);
    typename V::I nan = typename V::I{};
    for (; i + kLanes <= n; i += kLanes) {
      for (int k = 0; k < kLanes / W; ++k) {
        const typename V::F x = V::load(v + i + k * W);
        acc[k] = V::select(kMax ? x > acc[k] : x < acc[k], x, acc[k]);
        nan |= x != x;
      }
    }
    for (int k = 0; k < kLanes / W; ++k) V::store(lane + k * W, acc[k]);
    for (int j = 0; j < W; ++j)
      if (nan[j]) lane[0] = std::numeric_limits<A>::quiet_NaN();
  } else {
    for (int j = 0; j < kLanes; ++j) lane[j] = id;
  }
  const auto pick = [](A run, A x) {  // x when it beats run or is NaN; a NaN run stays
    const bool take = (kMax ? x > run : x < run) | (x != x);
    return take ? x : run;
  };
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = pick(lane[j], v[i + j]);
  for (int j = 0; i + j < n; ++j) lane[j] = pick(lane[j], v[i + j]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = pick(lane[j], lane[j + w]);
  return lane[0];
}

// out[i] = exp(in[i] - sub): Vec::exp for float (a partial last vector through a padded copy, so
// every element takes the same instructions), libm for double.
template <int W, class A>
inline void exp_shifted(const A* in, A sub, A* out, int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    using V = Vec<W>;
    int64_t i = 0;
    for (; i + W <= n; i += W) V::store(out + i, V::exp(V::load(in + i) - sub));
    if (i < n) {
      float pad[W] = {};
      for (int64_t j = i; j < n; ++j) pad[j - i] = in[j];
      V::store(pad, V::exp(V::load(pad) - sub));
      for (int64_t j = i; j < n; ++j) out[j] = pad[j - i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = std::exp(in[i] - sub);
  }
}

// Sum of exp(in[i] - sub) over m <= kSumBlock elements in block_sum's lanes and order, without
// storing the exps (float: Vec::exp; double: libm).
template <int W, class A>
inline A block_exp_sum(const A* in, A sub, int64_t m) {
  A lane[kLanes] = {};
  int64_t i = 0;
  if constexpr (std::is_same_v<A, float>) {
    using V = Vec<W>;
    typename V::F acc[kLanes / W];
    for (auto& a : acc) a = V::splat(0.0f);
    for (; i + kLanes <= m; i += kLanes)
      for (int k = 0; k < kLanes / W; ++k) acc[k] += V::exp(V::load(in + i + k * W) - sub);
    for (int k = 0; k < kLanes / W; ++k) V::store(lane + k * W, acc[k]);
    float tail[kLanes] = {};
    const int rest = static_cast<int>(m - i);
    for (int j = 0; j < rest; ++j) tail[j] = in[i + j];
    for (int k = 0; k < kLanes / W; ++k) {
      const typename V::F e = V::exp(V::load(tail + k * W) - sub);
      float ev[W];
      V::store(ev, e);
      for (int j = 0; j < W; ++j)
        if (k * W + j < rest) lane[k * W + j] += ev[j];
    }
  } else {
    for (; i + kLanes <= m; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += std::exp(in[i + j] - sub);
    for (int j = 0; i + j < m; ++j) lane[j] += std::exp(in[i + j] - sub);
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

// Sum over [0, n) of t = (v[i] - shift) - mean, computed in A (for layer_norm: x - x[0] is exact,
// see layer_norm_cpu.cc), or with kSquares of t^2 squared in double; in double, 8 double lanes in
// order folded as a tree (the normalizations' statistics, where float32 lanes were not accurate
// enough: tests/test_fuzz.py).
constexpr int kDoubleLanes = 8;
template <int W, bool kSquares = false, class A>
inline double dsum(const A* v, int64_t n, A shift = A(0), A mean = A(0)) {
  using V = Vec<W>;
  constexpr int kPer = W / 2;  // doubles a vector
  typename V::D acc[kDoubleLanes / kPer];
  for (auto& a : acc) a = typename V::D{};
  int64_t i = 0;
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
  for (int w = kDoubleLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

// ORs n flags (nonzero: bit set) into bits [bit0, bit0 + n) of `words` (bit j of word i is bit
// 32 i + j), 32 flags at a time; bits that straddle two words are split between them.
inline void pack_bits(const int32_t* flags, int64_t n, uint32_t* words, int64_t bit0) {
  for (int64_t k = 0; k < n; k += 32) {
    const int m = n - k < 32 ? static_cast<int>(n - k) : 32;
    uint32_t w = 0;
    if (m == 32) {
      for (int j = 0; j < 32; ++j) w |= kBit[j] & ones_if<uint32_t>(flags[k + j] != 0);
    } else {
      for (int j = 0; j < m; ++j) w |= kBit[j] & ones_if<uint32_t>(flags[k + j] != 0);
    }
    const int64_t p = bit0 + k;
    const int off = static_cast<int>(p & 31);
    words[p >> 5] |= w << off;
    if (off != 0 && (w >> (32 - off)) != 0) words[(p >> 5) + 1] |= w >> (32 - off);
  }
}

// Bits [bit0, bit0 + n) of `words` as flags: all ones where set, else 0.
inline void unpack_bits(const uint32_t* words, int64_t bit0, int64_t n, int32_t* flags) {
  for (int64_t k = 0; k < n; k += 32) {
    const int m = n - k < 32 ? static_cast<int>(n - k) : 32;
    const int64_t p = bit0 + k;
    const int off = static_cast<int>(p & 31);
    uint32_t w = words[p >> 5] >> off;
    if (off != 0 && m > 32 - off) w |= words[(p >> 5) + 1] << (32 - off);  // only bits that exist
    if (m == 32) {
      for (int j = 0; j < 32; ++j) flags[k + j] = ones_if<int32_t>((w & kBit[j]) != 0);
    } else {
      for (int j = 0; j < m; ++j) flags[k + j] = ones_if<int32_t>((w & kBit[j]) != 0);
    }
  }
}

}  // namespace jaxops::cpu
