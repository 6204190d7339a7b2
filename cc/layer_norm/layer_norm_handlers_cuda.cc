// CUDA FFI handlers for layer_norm / rms_norm, forward and backward. They validate like the
// CPU handlers, then only enqueue kernels on XLA's stream (CUDA-graph safe).
#include "common/cuda_status.h"
#include "common/registry.h"
#include "layer_norm/layer_norm_args.h"
#include "layer_norm/layer_norm_cuda.h"

namespace jaxops::layer_norm {
namespace {

ffi::Error LayerNormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(false, x, scale, &bias, *y, &*mean, *rstd, epsilon, &a); err.failure())
    return err;
  if (is_empty(a.shape)) return ffi::Error::Success();
  return cuda_status(forward_cuda(a, stream), "layer_norm");
}

ffi::Error RmsNormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(true, x, scale, nullptr, *y, nullptr, *rstd, epsilon, &a); err.failure())
    return err;
  if (is_empty(a.shape)) return ffi::Error::Success();
  return cuda_status(forward_cuda(a, stream), "rms_norm");
}

ffi::Error LayerNormBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                            ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(false, x, scale, &mean, rstd, dy, *dx, *dscale, &*dbias, *workspace, &a);
      err.failure())
    return err;
  if (is_empty(a.shape)) return ffi::Error::Success();
  return cuda_status(backward_cuda(a, stream), "layer_norm_bwd");
}

ffi::Error RmsNormBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer rstd,
                          ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(true, x, scale, nullptr, rstd, dy, *dx, *dscale, nullptr, *workspace, &a);
      err.failure())
    return err;
  if (is_empty(a.shape)) return ffi::Error::Success();
  return cuda_status(backward_cuda(a, stream), "rms_norm_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormForwardCuda, LayerNormFwdCuda,
                              bind_layer_norm_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormForwardCuda, RmsNormFwdCuda,
                              bind_rms_norm_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBackwardCuda, LayerNormBwdCuda,
                              bind_layer_norm_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBackwardCuda, RmsNormBwdCuda,
                              bind_rms_norm_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_layer_norm_fwd", LayerNormForwardCuda);
JAXOPS_REGISTER("jaxops_rms_norm_fwd", RmsNormForwardCuda);
JAXOPS_REGISTER("jaxops_layer_norm_bwd", LayerNormBackwardCuda);
JAXOPS_REGISTER("jaxops_rms_norm_bwd", RmsNormBackwardCuda);

}  // namespace jaxops::layer_norm
