// CUDA FFI handlers for relu forward and backward (validate, then launch on XLA's stream).
#include "common/cuda_status.h"
#include "common/registry.h"
#include "relu/relu_args.h"
#include "relu/relu_launch.h"

namespace jaxops::relu {
namespace {

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> mask, int64_t with_mask) {
  View v;
  if (auto err = check_forward(x, *y, *mask, with_mask != 0, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  return cuda_status(forward_cuda(stream, v.dtype, x.untyped_data(), y->untyped_data(),
                                  static_cast<uint32_t*>(mask->untyped_data()), v.rows, v.cols,
                                  v.words_per_row),
                     "relu");
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer mask,
                        ffi::Result<ffi::AnyBuffer> dx) {
  View v;
  if (auto err = check_backward(dy, mask, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  return cuda_status(backward_cuda(stream, v.dtype, dy.untyped_data(),
                                   static_cast<const uint32_t*>(mask.untyped_data()), dx->untyped_data(),
                                   v.rows, v.cols, v.words_per_row),
                     "relu_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluForwardCuda, ForwardCuda,
                              bind_forward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluBackwardCuda, BackwardCuda,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_relu_fwd", ReluForwardCuda);
JAXOPS_REGISTER("jaxops_relu_bwd", ReluBackwardCuda);

}  // namespace jaxops::relu
