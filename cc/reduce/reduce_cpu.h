// CPU twin of the reduction kernels: the same operators (reduce_ops.h), pairwise order.
#pragma once
#include <cstdint>

#include "common/cpu_parts.h"
#include "common/dtype.h"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce {

// y[o, i] = op over r of x[o, r, i]; y is x's dtype (int32 for the arg ops).
// Returns false for an unsupported dtype.
bool reduce_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t outer, int64_t reduced,
                int64_t inner);

// The least elements worth handing to another thread: sums, extrema and the arg ops stream at
// ~0.02-0.05 ns an element, so a task's hand-off (~5-10 us on the development VM) needs 32x more
// of them than logsumexp's exps. Session 60's CLI (2 cores): 1024x1024 sums of columns on the pool
// in 32K-element pieces took 28 us against 15 on one thread; in 256K-element ones max still lost
// (24 -> 31 us); at 4096x1024 the pool is 1.1-5x faster.
inline int64_t reduce_grain(OpKind kind) {
  return kind == OpKind::kLogSumExp ? cpu::kParallelGrain : 32 * cpu::kParallelGrain;
}

// reduce_cpu of one slice (outer 1) with its rows split between threads on `ranges`: the same
// answer bit for bit (the same pairwise order). Returns false for an unsupported dtype.
bool reduce_slice_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t reduced, int64_t inner,
                      const cpu::ForRanges& ranges);

}  // namespace jaxops::reduce
