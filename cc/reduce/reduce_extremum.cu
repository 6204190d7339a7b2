// max and min kernels.
#include "reduce/reduce_launch.cuh"

namespace jaxops::reduce {
template <class A> using Max = ExtremumOp<A, true>;
template <class A> using Min = ExtremumOp<A, false>;
JAXOPS_REDUCE_LAUNCHER(launch_extremum, OpKind::kMax, Max, Min)
}  // namespace jaxops::reduce
