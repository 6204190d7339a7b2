// CPU FFI handlers for layer_norm / rms_norm, forward and backward.
#include "common/registry.h"
#include "layer_norm/layer_norm_args.h"
#include "layer_norm/layer_norm_cpu.h"

namespace jaxops::layer_norm {
namespace {

ffi::Error LayerNormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(false, x, scale, &bias, *y, &*mean, *rstd, epsilon, &a); err.failure())
    return err;
  if (!is_empty(a.shape)) forward_cpu(a);
  return ffi::Error::Success();
}

ffi::Error RmsNormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(true, x, scale, nullptr, *y, nullptr, *rstd, epsilon, &a); err.failure())
    return err;
  if (!is_empty(a.shape)) forward_cpu(a);
  return ffi::Error::Success();
}

ffi::Error LayerNormBwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                           ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(false, x, scale, &mean, rstd, dy, *dx, *dscale, &*dbias, *workspace, &a);
      err.failure())
    return err;
  if (!is_empty(a.shape)) backward_cpu(a);
  return ffi::Error::Success();
}

ffi::Error RmsNormBwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer rstd, ffi::AnyBuffer dy,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(true, x, scale, nullptr, rstd, dy, *dx, *dscale, nullptr, *workspace, &a);
      err.failure())
    return err;
  if (!is_empty(a.shape)) backward_cpu(a);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormForwardCpu, LayerNormFwdCpu, bind_layer_norm_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormForwardCpu, RmsNormFwdCpu, bind_rms_norm_fwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBackwardCpu, LayerNormBwdCpu, bind_layer_norm_bwd(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBackwardCpu, RmsNormBwdCpu, bind_rms_norm_bwd(ffi::Ffi::Bind()));
JAXOPS_REGISTER("jaxops_layer_norm_fwd", LayerNormForwardCpu);
JAXOPS_REGISTER("jaxops_rms_norm_fwd", RmsNormForwardCpu);
JAXOPS_REGISTER("jaxops_layer_norm_bwd", LayerNormBackwardCpu);
JAXOPS_REGISTER("jaxops_rms_norm_bwd", RmsNormBackwardCpu);

}  // namespace jaxops::layer_norm
