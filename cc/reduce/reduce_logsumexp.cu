// logsumexp kernels (one online (max, sum) pass).
#include "reduce/reduce_launch.cuh"

namespace jaxops::reduce {
JAXOPS_REDUCE_LAUNCHER(launch_logsumexp, OpKind::kLogSumExp, LogSumExpOp, LogSumExpOp)
}  // namespace jaxops::reduce
