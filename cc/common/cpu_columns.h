// Column sums, extrema and centred sums for the CPU twins (the reductions' columns, batch_norm's
// per-channel statistics): rows added in order into float states, a tile of columns at a time
// held in vector registers across the rows, read in place (no scratch row). The recursive column
// twin these replace ran outside the AVX2 clone (flatten cannot inline recursion) and loaded and
// stored its accumulators for every row: ~1 cycle an element (session 54).
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::cpu {

// The drivers' common walk over columns: tile(c, nv) for tiles of kTile vectors of W columns, then
// of kTile / 2, ... 1 (nv a std::integral_constant<int, NV>, so the tile is a template argument):
// narrow slabs (64 columns of 16 lanes) still keep several independent chains in flight; one
// vector at a time left the adds waiting on each other (session 60: sum of 65536 x 64 float32
// columns 1.1 ms against XLA's 0.2). Returns the first column not covered (fewer than W are left).
template <int W, int kTile, class Tile>
inline int64_t column_tiles(int64_t inner, Tile&& tile) {
  int64_t c = 0;
  for (; c + kTile * W <= inner; c += kTile * W) tile(c, std::integral_constant<int, kTile>{});
  if constexpr (kTile > 1)
    return c + column_tiles<W, kTile / 2>(inner - c, [&](int64_t at, auto nv) { tile(c + at, nv); });
  return c;
}

// acc[c] for c in [0, NV * W) = acc[c] then x[r * inner + c] for r in [0, rows) in order, summed
// (kSum) or their max (kMax) / min propagating NaN like jnp.max. The extrema keep whether a NaN
// came apart and put it in at the end, so each row costs its chain one maxps / minps (with the
// NaN test and a bitwise select in the chain, float32 columns ran 2.5x a sum's time; session 60).
template <int W, int NV, bool kSum, bool kMax, class T>
inline void column_tile(const T* x, int64_t rows, int64_t inner, float* acc) {
  using V = Vec<W>;
  typename V::F a[NV];
  typename V::I nan[NV];
  for (int k = 0; k < NV; ++k) a[k] = V::load(acc + k * W), nan[k] = typename V::I{};
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < NV; ++k) {
      const typename V::F v = load_floats<W>(x + r * inner + k * W);
      if constexpr (kSum) {
        a[k] += v;
      } else {
        a[k] = V::template keep_better<kMax>(v, a[k]);  // a NaN a[k] stays
        nan[k] |= V::is_nan(v);
      }
    }
  if constexpr (!kSum)
    for (int k = 0; k < NV; ++k) a[k] = V::select(nan[k], V::splat(std::numeric_limits<float>::quiet_NaN()), a[k]);
  for (int k = 0; k < NV; ++k) V::store(acc + k * W, a[k]);
}

// column_tile over all `inner` columns: tiles of 8 (or 4), ... 1 vectors, then scalars.
template <int W, bool kSum, bool kMax, class T>
inline void column_leaf(const T* x, int64_t rows, int64_t inner, float* acc) {
  // (extrema hold a NaN flag a vector too: tiles of 4 where there are 16 registers)
  int64_t c = column_tiles<W, kSum || W == 16 ? 8 : 4>(inner, [&](int64_t at, auto nv) {
    column_tile<W, decltype(nv)::value, kSum, kMax>(x + at, rows, inner, acc + at);
  });
  for (; c < inner; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = to_float(x[r * inner + c]);
      if constexpr (kSum) acc[c] += v;
      else acc[c] = beats<kMax>(v, acc[c]) ? v : acc[c];
    }
}

// sum_d[c] += d and sum_d2[c] += d * d over rows [0, rows) in order, d = x[r * inner + c] - centre[c]
// in float (batch_norm's variance about a float mean: the caller corrects by the mean of d).
template <int W, int NV, class T>
inline void centred_tile(const T* x, int64_t rows, int64_t inner, const float* centre, float* sum_d, float* sum_d2) {
  using V = Vec<W>;
  typename V::F m[NV], s[NV], q[NV];
  for (int k = 0; k < NV; ++k) m[k] = V::load(centre + k * W), s[k] = V::load(sum_d + k * W), q[k] = V::load(sum_d2 + k * W);
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < NV; ++k) {
      const typename V::F d = load_floats<W>(x + r * inner + k * W) - m[k];
      s[k] += d;
      q[k] += d * d;
    }
  for (int k = 0; k < NV; ++k) V::store(sum_d + k * W, s[k]), V::store(sum_d2 + k * W, q[k]);
}

// centred_tile over all `inner` columns: tiles of 4, 2, 1 vectors, then scalars.
template <int W, class T>
inline void centred_sums(const T* x, int64_t rows, int64_t inner, const float* centre, float* sum_d, float* sum_d2) {
  int64_t c = column_tiles<W, 4>(inner, [&](int64_t at, auto nv) {
    centred_tile<W, decltype(nv)::value>(x + at, rows, inner, centre + at, sum_d + at, sum_d2 + at);
  });
  for (; c < inner; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float d = to_float(x[r * inner + c]) - centre[c];
      sum_d[c] += d;
      sum_d2[c] += d * d;
    }
}

// acc[c] += exp(x[r * inner + c] - centre[c]) over rows [0, rows) in order, with Vec::exp (the
// column logsumexp's sums; the same exps and order as exp_shifted over each row, a row at a time).
template <int W, int NV, class T>
inline void exp_tile(const T* x, int64_t rows, int64_t inner, const float* centre, float* acc) {
  using V = Vec<W>;
  typename V::F m[NV], a[NV];
  for (int k = 0; k < NV; ++k) m[k] = V::load(centre + k * W), a[k] = V::load(acc + k * W);
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < NV; ++k) a[k] += V::exp(load_floats<W>(x + r * inner + k * W) - m[k]);
  for (int k = 0; k < NV; ++k) V::store(acc + k * W, a[k]);
}

// exp_tile over all `inner` columns: tiles of 2 vectors (the exp's constants need the other
// registers), then single vectors, then the last columns through one padded vector a row.
template <int W, class T>
inline void column_exp_sums(const T* x, int64_t rows, int64_t inner, const float* centre, float* acc) {
  using V = Vec<W>;
  const int64_t c = column_tiles<W, 2>(inner, [&](int64_t at, auto nv) {
    exp_tile<W, decltype(nv)::value>(x + at, rows, inner, centre + at, acc + at);
  });
  const int rest = static_cast<int>(inner - c);
  if (rest == 0) return;
  for (int64_t r = 0; r < rows; ++r) {
    float pad[W] = {}, e[W];
    for (int j = 0; j < rest; ++j) pad[j] = to_float(x[r * inner + c + j]) - centre[c + j];
    V::store(e, V::exp(V::load(pad)));
    for (int j = 0; j < rest; ++j) acc[c + j] += e[j];
  }
}

// argmax (kMax) / argmin of columns [0, NV * W) over rows [0, rows), in order: best[c] and idx[c]
// (row index base + r) are replaced where the element beats best[c] or is the first NaN
// (ArgOp::add's rule: ties keep the earlier row, a NaN best is final).
template <int W, int NV, bool kMax, class T>
inline void arg_tile(const T* x, int64_t base, int64_t rows, int64_t inner, float* best, int32_t* idx) {
  using V = Vec<W>;
  typename V::F b[NV];
  typename V::I ix[NV];
  for (int k = 0; k < NV; ++k) {
    b[k] = V::load(best + k * W);
    std::memcpy(&ix[k], idx + k * W, sizeof ix[k]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const typename V::I at = typename V::I{} + static_cast<int32_t>(base + r);
    for (int k = 0; k < NV; ++k) {
      const typename V::F v = load_floats<W>(x + r * inner + k * W);
      const typename V::I take = V::eq(b[k], b[k]) & ~(kMax ? V::le(v, b[k]) : V::ge(v, b[k]));
      b[k] = V::select(take, v, b[k]);
      ix[k] = (take & at) | (~take & ix[k]);
    }
  }
  for (int k = 0; k < NV; ++k) {
    V::store(best + k * W, b[k]);
    std::memcpy(idx + k * W, &ix[k], sizeof ix[k]);
  }
}

// arg_tile over all `inner` columns: tiles of 4, 2, 1 vectors, then scalars.
template <int W, bool kMax, class T>
inline void column_arg_leaf(const T* x, int64_t base, int64_t rows, int64_t inner, float* best, int32_t* idx) {
  int64_t c = column_tiles<W, 4>(inner, [&](int64_t at, auto nv) {
    arg_tile<W, decltype(nv)::value, kMax>(x + at, base, rows, inner, best + at, idx + at);
  });
  for (; c < inner; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = to_float(x[r * inner + c]);
      if (best[c] == best[c] && !(kMax ? v <= best[c] : v >= best[c])) best[c] = v, idx[c] = static_cast<int32_t>(base + r);
    }
}

}  // namespace jaxops::cpu
