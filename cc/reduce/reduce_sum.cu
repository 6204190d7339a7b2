// sum and mean kernels.
#include "reduce/reduce_launch.cuh"

namespace jaxops::reduce {
template <class A> using Sum = SumOp<A, false>;
template <class A> using Mean = SumOp<A, true>;
JAXOPS_REDUCE_LAUNCHER(launch_sum, OpKind::kSum, Sum, Mean)
}  // namespace jaxops::reduce
