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
  // cuda::dram_outruns_sms for the launching device: picks between plans whose results are the same
  // bits (16-bit argmax / argmin rows, row_packs_per_thread).
  bool fast_dram;
};

cudaError_t launch_sum(const Plan& p, cudaStream_t stream);        // kSum, kMean
cudaError_t launch_extremum(const Plan& p, cudaStream_t stream);   // kMax, kMin
cudaError_t launch_logsumexp(const Plan& p, cudaStream_t stream);  // kLogSumExp
cudaError_t launch_arg(const Plan& p, cudaStream_t stream);        // kArgMax, kArgMin

}  // namespace jaxops::reduce
