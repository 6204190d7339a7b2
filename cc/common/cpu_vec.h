// Explicit vectors for the CPU twins' inner loops and the dispatch between their three builds.
// Each entry point runs through run_isa: the baseline x86-64 ISA (SSE2, 4-float vectors)
// everywhere, an AVX2+FMA clone (8-float vectors) where the CPU has it, an AVX-512 clone
// (16-float vectors, session 58) where it has AVX-512 F / DQ / BW / VL. Session 52 (2 AMD EPYC
// cores, 1M elements): built with -Os (nanobind's default) and with libm's exp, branches and a
// 64-bit division an element, the twins ran 10-90x slower than XLA's own CPU code
// (docs/notes/cpu.md). The loops themselves: cpu_bits.h (selects, mask bits), cpu_rows.h
// (storage <-> float rows), cpu_sums.h (sums, extrema, exp).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace jaxops::cpu {

// W floats (GCC/Clang vector extensions): W = 4 is the SSE2 register every x86-64 has; W = 8
// runs in AVX2+FMA clones of the entry points (run_isa), W = 16 in AVX-512 ones. The loops below
// use them directly because the auto-vectorizer scalarized the lane arrays of the NaN-propagating
// max (session 52: 1.2 ns an element, against 0.07 for the sum it did vectorize). Code with W = 8
// or 16 is only ever inlined into such a clone: outside one, GCC lowered 32-byte compares and
// selects to scalar branches. Comparisons go through VecCmp (below), whatever W.
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef double vd2 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef double vd4 __attribute__((vector_size(32)));
typedef float vf2 __attribute__((vector_size(8)));
typedef uint16_t vu4 __attribute__((vector_size(8)));
typedef uint16_t vu8 __attribute__((vector_size(16)));
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef double vd8 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
template <int W> struct VecTypes;  // (GCC drops vector_size on a typedef whose size is dependent)
template <> struct VecTypes<4> {
  using F = vf4;
  using H = vf2;
  using U16 = vu4;
  using I = vi4;
  using D = vd2;
};
template <> struct VecTypes<8> {
  using F = vf8;
  using H = vf4;
  using U16 = vu8;
  using I = vi8;
  using D = vd4;
};

template <> struct VecTypes<16> {
  using F = vf16;
  using H = vf8;
  using U16 = vu16;
  using I = vi16;
  using D = vd8;
};

// Vector comparisons, all ones where true. At W = 16 they are defined under the AVX-512 target:
// GCC builds a helper's comparisons for the target the helper is compiled for (lane-wide masks
// for SSE / AVX2) before `flatten` inlines it into the AVX-512 clone, which has no 64-byte
// instruction for such a mask and compares one lane at a time (session 58, notes/cpu.md: max of
// float columns 18x slower). A comparison compiled under AVX-512 uses its mask registers, and
// once inlined into the clone the surrounding helper's integer and float operations stay 512-bit.
template <int W>
struct VecCmp {
  using F = typename VecTypes<W>::F;
  using I = typename VecTypes<W>::I;
  static I lt(F a, F b) { return a < b; }
  static I le(F a, F b) { return a <= b; }
  static I eq(F a, F b) { return a == b; }
  static I ne(F a, F b) { return a != b; }
  // x where x > run (x < run), else run: one maxps (minps), whose IEEE rule this is exactly (a NaN
  // in either keeps run). The bitwise select of the same thing is a compare and two instructions.
  static F max_or_run(F x, F run) { return x > run ? x : run; }
  static F min_or_run(F x, F run) { return x < run ? x : run; }
};
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define JAXOPS_AVX512_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")))
template <>
struct VecCmp<16> {  // (not always_inline: inlined only into the AVX-512 clone, by flatten)
  JAXOPS_AVX512_TARGET static vi16 lt(vf16 a, vf16 b) { return a < b; }
  JAXOPS_AVX512_TARGET static vi16 le(vf16 a, vf16 b) { return a <= b; }
  JAXOPS_AVX512_TARGET static vi16 eq(vf16 a, vf16 b) { return a == b; }
  JAXOPS_AVX512_TARGET static vi16 ne(vf16 a, vf16 b) { return a != b; }
  JAXOPS_AVX512_TARGET static vf16 max_or_run(vf16 x, vf16 run) { return x > run ? x : run; }
  JAXOPS_AVX512_TARGET static vf16 min_or_run(vf16 x, vf16 run) { return x < run ? x : run; }
};
#endif

template <int W>
struct Vec {
  using F = typename VecTypes<W>::F;  // W floats
  using I = typename VecTypes<W>::I;  // W int32
  using D = typename VecTypes<W>::D;  // W / 2 doubles
  using H = typename VecTypes<W>::H;  // W / 2 floats
  using U16 = typename VecTypes<W>::U16;  // W uint16 (16-bit storage)
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
  // Comparisons through VecCmp (every vector comparison of the twins goes through these).
  static I lt(F a, F b) { return VecCmp<W>::lt(a, b); }
  static I le(F a, F b) { return VecCmp<W>::le(a, b); }
  static I gt(F a, F b) { return VecCmp<W>::lt(b, a); }
  static I ge(F a, F b) { return VecCmp<W>::le(b, a); }
  static I eq(F a, F b) { return VecCmp<W>::eq(a, b); }
  static I is_nan(F a) { return VecCmp<W>::ne(a, a); }
  // x where it beats run in a max (kMax) or min, else run (NaN in either: run).
  template <bool kMax>
  static F keep_better(F x, F run) {
    return kMax ? VecCmp<W>::max_or_run(x, run) : VecCmp<W>::min_or_run(x, run);
  }
  // W / 2 doubles from as many consecutive A values, centred first in A: (p - shift) - mean.
  template <class A>
  static D widen_d(const A* p, A shift, A mean) {
    D d;
    for (int k = 0; k < W / 2; ++k) d[k] = static_cast<double>((p[k] - shift) - mean);
    return d;
  }
  // The two halves of v as doubles: lo = v[0, W/2), hi = v[W/2, W). Element by element, because
  // GCC 12 lowers __builtin_convertvector(vf4 -> vd4) to two 2-wide conversions and a merge.
  static void to_doubles(F v, D* lo, D* hi) {
    H h[2];
    std::memcpy(h, &v, sizeof v);
    D a, b;
    for (int k = 0; k < W / 2; ++k) a[k] = h[0][k];
    for (int k = 0; k < W / 2; ++k) b[k] = h[1][k];
    *lo = a;
    *hi = b;
  }

  // exp(d) in float32 for d <= 88 (softmax and logsumexp only take exp(x - max) <= 1): Cody-Waite
  // reduction d = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial (about 1 ulp), scaled
  // by 2^n through the exponent bits. Exact at 0 (exp(0) = 1, as the row maximum needs); d <= -87.3
  // gives 0 (no subnormals); NaN stays NaN; -inf gives 0.
  // The polynomial runs in Estrin's form (three independent pairs, then two steps) and n comes
  // from the bits of n + 1.5 * 2^23, not a conversion: the dependent chain shrank from ~60 cycles
  // to ~40 (session 54: logsumexp rows 10% faster). Same accuracy over every float in [-87, 88]:
  // 1.02 ulp max against 1.01 with FMA (W = 8), 0.99 against 0.98 without, mean 0.063 ulp.
  static F exp(F d) {
    // Below -87.3 the answer is 0 (the last line), and the arithmetic runs on -87.3, where y is
    // still normal: a subnormal product costs a microcode assist of ~100 cycles on x86. At -87.5
    // every masked (-inf) softmax entry took one: 2.5x the time of an unmasked row (session 55).
    d = select(lt(d, splat(-87.3f)), splat(-87.3f), d);  // also -inf; a NaN d fails and stays
    d = select(gt(d, splat(88.0f)), splat(88.0f), d);
    const F magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const F n_magic = d * 1.44269504088896341f + magic;  // its low mantissa bits hold n
    const F n = n_magic - magic;
    const F r = (d - n * 0.693359375f) + n * 2.12194440e-4f;
    const F r2 = r * r;
    const F a = r * 1.9875691500e-4f + 1.3981999507e-3f;
    const F b = r * 8.3334519073e-3f + 4.1665795894e-2f;
    const F c = r * 1.6666665459e-1f + 5.0000001201e-1f;
    const F p = (a * r2 + b) * r2 + c;
    // n in [-126, 127]: a normal exponent field. For a NaN d the bits are garbage, but p is NaN.
    const I ni = bits(n_magic) - bits(magic);
    const F y = ((p * r2 + r) + 1.0f) * floats((ni + 127) << 23);
    // 0 for -inf and whatever would round to a subnormal (a NaN d fails the test: kept).
    return floats(bits(y) & ~le(d, splat(-87.3f)));
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
// f(std::integral_constant<int, 16>) in an AVX-512 (F, DQ, BW, VL) clone, as run_avx2.
template <class F>
JAXOPS_AVX512_TARGET __attribute__((flatten)) auto run_avx512(F& f) {
  return f(std::integral_constant<int, 16>{});
}
inline bool has_avx512() {
  static const bool yes = has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

// JAXOPS_CPU_ISA=baseline keeps every call on the baseline code (W = 4), =avx2 on the AVX2 clone
// (W = 8), so that tests/test_cpu_isa.py checks every path on one machine; read per call.
inline bool is_isa(const char* forced, const char* name) { return forced != nullptr && std::strcmp(forced, name) == 0; }

// Runs f(std::integral_constant<int, W>): W = 16 in an AVX-512 clone where the CPU has AVX-512
// (F, DQ, BW, VL) and kMaxW allows it, 8 in an AVX2+FMA clone where the CPU has them (results may
// differ in the last bits from W = 4's, which has no fused multiply-add), else 4. Session 58's C++
// harnesses (.runs/s54_mb, .runs/s55_mb; 2 AMD EPYC cores, 1024x1024, AVX2 -> AVX-512, two rounds
// within 4 % of each other but the norms' backward, which moved 30 %): softmax / log_softmax
// forward 15-22 % faster, backward 2-30 % (but float32 masked softmax backward 11 % slower),
// layer_norm / rms_norm forward 0-12 %, logsumexp 20-24 %, sums and extrema of columns 5-25 %,
// argmax of columns 14-23 %. batch_norm lost 13-32 % (one round, CI running beside it), so it
// keeps kMaxW = 8, as does relu (auto-vectorized, bound by memory).
template <int kMaxW = 16, class F>
auto run_isa(F&& f) {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  const char* forced = std::getenv("JAXOPS_CPU_ISA");
  if (!is_isa(forced, "baseline")) {
    if constexpr (kMaxW >= 16)
      if (has_avx512() && !is_isa(forced, "avx2")) return run_avx512(f);
    if (has_avx2()) return run_avx2(f);
  }
#endif
  return f(std::integral_constant<int, 4>{});
}

// f(std::integral_constant<int, W>) in the clone run_isa chose W for (run_avx512 / run_avx2 /
// baseline), without choosing again: for code of a W clone that leaves it (a std::function's body
// is compiled for the baseline ISA) and must come back to the same W.
template <int W, class F>
auto run_at(F&& f) {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (W == 16) return run_avx512(f);
  else if constexpr (W == 8) return run_avx2(f);
  else return f(std::integral_constant<int, 4>{});
#else
  static_assert(W == 4, "wider clones exist on x86-64 only");
  return f(std::integral_constant<int, 4>{});
#endif
}

}  // namespace jaxops::cpu
