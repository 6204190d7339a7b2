// Launchers of the CUDA reduction kernels (host-callable, no FFI headers), one per operator
// group so each group compiles in its own translation unit.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce {

// One reduction launch: x viewed as (outer, reduced, inner); `splits` chunks of the reduced
// axis (> 1 uses ws for the partial states, merged by a second kernel in a fixed order).
struct Plan {
  OpKind kind;
  Dtype dtype;
  const void* x;
  void* y;
  void* ws;
  int64_t outer;
  int64_t reduced;
  int64_t inner;
  int64_t splits;
};

cudaError_t launch_sum(const Plan& p, cudaStream_t stream);        // kSum, kMean
cudaError_t launch_extremum(const Plan& p, cudaStream_t stream);   // kMax, kMin
cudaError_t launch_logsumexp(const Plan& p, cudaStream_t stream);  // kLogSumExp
cudaError_t launch_arg(const Plan& p, cudaStream_t stream);        // kArgMax, kArgMin

}  // namespace jaxops::reduce
