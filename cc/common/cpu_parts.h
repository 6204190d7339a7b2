// How the CPU twins split work between threads, without the FFI (the twins' own files include
// this; cpu_parallel.h runs the pieces on XLA's pool).
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>

namespace jaxops::cpu {

// Runs fn(begin, end) over disjoint ranges covering [0, n), `cost` elements a unit: the twins'
// own files take one of these (cpu::on_pool in cpu_parallel.h puts it on XLA's pool).
using ForRanges = std::function<void(int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn)>;

// Below this many elements a piece, a task's hand-off costs more than it saves.
inline constexpr int64_t kParallelGrain = 1 << 15;

// The consecutive row ranges a sum over the rows of each group is split into: a function of the
// shape alone, so that the sums come out the same whatever the thread count (each range summed in
// row order, the ranges added in order). One range when there are groups enough to share out
// (vmap's), else up to 8 of at least max(min_rows, kParallelGrain / cols) rows.
inline int64_t row_parts(int64_t groups, int64_t rows, int64_t cols, int64_t min_rows) {
  if (groups >= 8) return 1;
  const int64_t least = std::max(min_rows, kParallelGrain / std::max<int64_t>(cols, 1));
  return std::clamp<int64_t>(rows / std::max<int64_t>(least, 1), 1, 8);
}

// Rows [begin, end) of range p of `parts` over `rows` rows.
inline void part_rows(int64_t rows, int64_t parts, int64_t p, int64_t* begin, int64_t* end) {
  *begin = rows * p / parts;
  *end = rows * (p + 1) / parts;
}

}  // namespace jaxops::cpu
