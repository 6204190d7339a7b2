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

// reduce_cpu of one slice (outer 1) with its rows split between threads on `ranges`: the same
// answer bit for bit (the same pairwise order). Returns false for an unsupported dtype.
bool reduce_slice_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t reduced, int64_t inner,
                      const cpu::ForRanges& ranges);

}  // namespace jaxops::reduce
