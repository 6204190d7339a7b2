// Rows between their storage type and the CPU twins' accumulation type (float; double for
// float64): the twins widen a row into scratch, compute there a vectorizable pass at a time, and
// narrow it back. cpu_float.h's conversions are branch-free, so these loops vectorize.
#pragma once
#include <cstdint>

#include "common/cpu_float.h"

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

}  // namespace jaxops::cpu
