// argmax and argmin kernels.
#include "reduce/reduce_launch.cuh"

namespace jaxops::reduce {
template <class A> using ArgMax = ArgOp<A, true>;
template <class A> using ArgMin = ArgOp<A, false>;
JAXOPS_REDUCE_LAUNCHER(launch_arg, OpKind::kArgMax, ArgMax, ArgMin)
}  // namespace jaxops::reduce
