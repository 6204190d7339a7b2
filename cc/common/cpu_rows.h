// Rows between their storage type and the CPU twins' accumulation type (float; double for
// float64): the twins widen a row into scratch, compute there a vectorizable pass at a time, and
// narrow it back. cpu_float.h's conversions are branch-free, so these loops vectorize.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cpu_float.h"
#include "common/cpu_vec.h"

namespace jaxops::cpu {

// Storage row -> accumulation-type row (float; double for float64).
template <class T, class A>
inline void widen(const T* src, A* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(to_float(src[i]));
}

// Accumulation-type row -> storage row, rounding to nearest even.
template <class T, class A>
inline void narrow(const A* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// Row src in the accumulation type: src itself for float / double rows (no copy), else widened
// into scratch (n values).
template <class T, class A>
inline const A* acc_row(const T* src, A* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    widen(src, scratch, n);
    return scratch;
  }
}

// Whether two passes over a block of n values of T (a max, then exps) read it in place rather
// than widened into float scratch first: float / double always; bf16 blocks of fewer than
// kShortBf16Block in the AVX2 / AVX-512 clones (W > 4), where the first pass's vector loads right
// after the widening's stores stalled on store forwarding (session 75, AVX-512: bf16 16-element
// logsumexp rows 77 -> 37 ns, softmax 65536x16 2.6 -> 1.2 ms). float16 converts a lane at a time
// in place (softmax 16384x32: 0.43 -> 1.16 ms), and so does the baseline build's bf16: they widen.
constexpr int64_t kShortBf16Block = 64;
template <int W, class T>
constexpr bool two_passes_in_place(int64_t n) {
  return std::is_same_v<T, acc_t<T>> || (W > 4 && std::is_same_v<T, bf16> && n < kShortBf16Block);
}

// Where an output row is computed: dst itself for float / double rows, else scratch, which
// narrow_row then stores.
template <class T, class A>
inline A* acc_out(T* dst, A* scratch) {
  if constexpr (std::is_same_v<T, A>) return dst;
  else return scratch;
}
template <class T, class A>
inline void narrow_row(const A* scratch, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, A>) narrow(scratch, dst, n);
}

// W consecutive storage values as a vector of floats, for loops that read rows in place: float
// as it is, bfloat16 by widening its bits and shifting them up, float16 a lane at a time.
template <int W, class T>
inline typename Vec<W>::F load_floats(const T* p) {
  using V = Vec<W>;
  if constexpr (std::is_same_v<T, float>) {
    return V::load(p);
  } else if constexpr (std::is_same_v<T, bf16>) {
    typename V::U16 h;
    std::memcpy(&h, p, sizeof h);
    typename V::I i;
    for (int k = 0; k < W; ++k) i[k] = h[k];
    return V::floats(i << 16);
  } else {
    typename V::F v;
    for (int k = 0; k < W; ++k) v[k] = to_float(p[k]);
    return v;
  }
}

}  // namespace jaxops::cpu
