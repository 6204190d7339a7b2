// CUDA FFI handler of every reduction: validates, then launches on XLA's stream (no
// allocation, no synchronisation; CUDA-graph safe).
#include <cuda_runtime_api.h>

#include "common/cuda_status.h"
#include "common/device_info.h"
#include "common/registry.h"
#include "reduce/reduce_args.h"
#include "reduce/reduce_cuda.h"

namespace jaxops::reduce {
namespace {

ffi::Error ReduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> ws, int64_t op, int64_t splits) {
  View v;
  if (auto err = check_reduce(x, *y, *ws, op, splits, &v); err.failure()) return err;
  if (v.outer * v.inner == 0) return ffi::Error::Success();
  if (v.reduced == 0) v.splits = 1;  // nothing to split: identities only
  // Only argmax / argmin plans read the chip (Plan::fast_dram); the other ops skip the query.
  bool fast_dram = false;
  if (is_arg(v.kind)) {
    cuda::DeviceInfo info;
    if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return cuda_status(err, op_name(v.kind));
    fast_dram = cuda::dram_outruns_sms(info);
  }
  const Plan plan{v.kind,  v.dtype,   x.untyped_data(), y->untyped_data(), ws->untyped_data(),
                  v.outer, v.reduced, v.inner,          v.splits,          fast_dram};
  cudaError_t status;
  switch (v.kind) {
    case OpKind::kSum:
    case OpKind::kMean: status = launch_sum(plan, stream); break;
    case OpKind::kMax:
    case OpKind::kMin: status = launch_extremum(plan, stream); break;
    case OpKind::kLogSumExp: status = launch_logsumexp(plan, stream); break;
    default: status = launch_arg(plan, stream); break;
  }
  return cuda_status(status, op_name(v.kind));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceCuda, ReduceCudaImpl,
                              bind_reduce(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_reduce", ReduceCuda);

}  // namespace jaxops::reduce
