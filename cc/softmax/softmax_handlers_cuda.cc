// CUDA FFI handlers for softmax / log_softmax, forward and backward.
#include "common/cuda_status.h"
#include "common/registry.h"
#include "softmax/softmax_args.h"
#include "softmax/softmax_cuda.h"

namespace jaxops::softmax {
namespace {

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                       ffi::Result<ffi::AnyBuffer> y, int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_forward(x, mask, masked, *y, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  return cuda_status(
      forward_cuda(v.dtype, x.untyped_data(), masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr,
                   y->untyped_data(), v.rows, v.cols, log != 0, stream),
      "softmax");
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer mask,
                        ffi::Result<ffi::AnyBuffer> dx, int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_backward(y, dy, mask, masked, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  return cuda_status(
      backward_cuda(v.dtype, y.untyped_data(), dy.untyped_data(),
                    masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr, dx->untyped_data(),
                    v.rows, v.cols, log != 0, stream),
      "softmax_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxForwardCuda, ForwardCuda,
                              bind_forward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBackwardCuda, BackwardCuda,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_softmax_fwd", SoftmaxForwardCuda);
JAXOPS_REGISTER("jaxops_softmax_bwd", SoftmaxBackwardCuda);

}  // namespace jaxops::softmax
