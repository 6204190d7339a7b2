// Column sums and extrema for the CPU reduction twin: rows added in order into float states,
// a tile of columns at a time held in vector registers across the rows, read in place (no
// scratch row). The recursive twin this replaces for float states ran outside the AVX2 clone
// (flatten cannot inline recursion) and loaded and stored its accumulators for every row:
// ~1 cycle an element (session 54).
#pragma once
#include <cstdint>

#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::reduce {

// acc[c] for c in [0, NV * W) = acc[c] then x[r * inner + c] for r in [0, rows) in order, summed
// (kSum) or their max (kMax) / min propagating NaN like jnp.max.
template <int W, int NV, bool kSum, bool kMax, class T>
inline void column_tile(const T* x, int64_t rows, int64_t inner, float* acc) {
  using V = cpu::Vec<W>;
  typename V::F a[NV];
  for (int k = 0; k < NV; ++k) a[k] = V::load(acc + k * W);
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < NV; ++k) {
      const typename V::F v = cpu::load_floats<W>(x + r * inner + k * W);
      if constexpr (kSum) a[k] += v;
      else a[k] = V::select((kMax ? v > a[k] : v < a[k]) | (v != v), v, a[k]);
    }
  for (int k = 0; k < NV; ++k) V::store(acc + k * W, a[k]);
}

// column_tile over all `inner` columns: tiles of 8 vectors, then single vectors, then scalars.
template <int W, bool kSum, bool kMax, class T>
inline void column_leaf(const T* x, int64_t rows, int64_t inner, float* acc) {
  constexpr int kTile = 8;
  int64_t c = 0;
  for (; c + kTile * W <= inner; c += kTile * W) column_tile<W, kTile, kSum, kMax>(x + c, rows, inner, acc + c);
  for (; c + W <= inner; c += W) column_tile<W, 1, kSum, kMax>(x + c, rows, inner, acc + c);
  for (; c < inner; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = cpu::to_float(x[r * inner + c]);
      if constexpr (kSum) acc[c] += v;
      else acc[c] = cpu::beats<kMax>(v, acc[c]) ? v : acc[c];
    }
}

}  // namespace jaxops::reduce
