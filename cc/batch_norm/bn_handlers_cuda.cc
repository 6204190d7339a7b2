// CUDA FFI handlers of batch_norm (validate, then launch on XLA's stream): statistics,
// normalize(+add+relu), both fused (training forward), backward reduce, backward dx.
#include "batch_norm/bn_args.h"
#include "batch_norm/bn_launch.h"
#include "common/cuda_status.h"
#include "common/registry.h"

namespace jaxops::batch_norm {
namespace {

ffi::Error StatsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> mean,
                     ffi::Result<ffi::AnyBuffer> var, ffi::Result<ffi::AnyBuffer> ws) {
  View v;
  int64_t cap = 0;
  if (auto err = check_stats(x, *mean, *var, *ws, &v, &cap); err.failure()) return err;
  if (v.elements() == 0) return ffi::Error::Success();
  return cuda_status(stats_cuda(stream, v, x.untyped_data(), mean->untyped_data(), var->untyped_data(),
                                ws->untyped_data(), cap),
                     "batch_norm");
}

ffi::Error ApplyCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                     ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer residual,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                     ffi::Result<ffi::AnyBuffer> coef, double eps, int64_t relu, int64_t with_mask,
                     int64_t has_residual) {
  View v;
  if (auto err = check_apply(x, scale, bias, mean, var, residual, *y, *mask, *coef, eps, relu, with_mask,
                             has_residual, &v);
      err.failure())
    return err;
  if (v.elements() == 0) return ffi::Error::Success();
  return cuda_status(apply_cuda(stream, v, x.untyped_data(), scale.untyped_data(), bias.untyped_data(),
                                mean.untyped_data(), var.untyped_data(),
                                has_residual ? residual.untyped_data() : nullptr, y->untyped_data(),
                                static_cast<uint32_t*>(mask->untyped_data()), coef->untyped_data(), eps,
                                relu != 0),
                     "batch_norm");
}

// Statistics and apply in one call: one cooperative kernel when x fits in shared memory
// (bn_resident.cu) or when a slice of it does (bn_hybrid.cu), else the two streaming passes.
ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                       ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> var,
                       ffi::Result<ffi::AnyBuffer> ws, ffi::Result<ffi::AnyBuffer> coef, double eps, int64_t relu,
                       int64_t with_mask, int64_t has_residual) {
  View v;
  int64_t cap = 0;
  if (auto err = check_forward(x, scale, bias, residual, *y, *mask, *mean, *var, *ws, *coef, eps, relu, with_mask,
                               has_residual, &v, &cap);
      err.failure())
    return err;
  if (v.elements() == 0) return ffi::Error::Success();
  const void* res = has_residual ? residual.untyped_data() : nullptr;
  auto* bits = static_cast<uint32_t*>(mask->untyped_data());
  bool launched = false;
  if (cudaError_t err = resident_forward_cuda(stream, v, x.untyped_data(), scale.untyped_data(),
                                              bias.untyped_data(), res, y->untyped_data(), bits,
                                              mean->untyped_data(), var->untyped_data(), ws->untyped_data(), cap,
                                              coef->untyped_data(), eps, relu != 0, &launched))
    return cuda_status(err, "batch_norm");
  if (launched) return ffi::Error::Success();
  if (cudaError_t err = hybrid_forward_cuda(stream, v, x.untyped_data(), scale.untyped_data(), bias.untyped_data(),
                                            res, y->untyped_data(), bits, mean->untyped_data(),
                                            var->untyped_data(), ws->untyped_data(), cap, coef->untyped_data(), eps,
                                            relu != 0, &launched))
    return cuda_status(err, "batch_norm");
  if (launched) return ffi::Error::Success();
  if (cudaError_t err = stats_cuda(stream, v, x.untyped_data(), mean->untyped_data(), var->untyped_data(),
                                   ws->untyped_data(), cap))
    return cuda_status(err, "batch_norm");
  return cuda_status(apply_cuda(stream, v, x.untyped_data(), scale.untyped_data(), bias.untyped_data(),
                                mean->untyped_data(), var->untyped_data(), res, y->untyped_data(), bits,
                                coef->untyped_data(), eps, relu != 0),
                     "batch_norm");
}

ffi::Error BackwardReduceCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                              ffi::AnyBuffer mask, ffi::AnyBuffer mean, ffi::AnyBuffer var,
                              ffi::Result<ffi::AnyBuffer> sum_dy, ffi::Result<ffi::AnyBuffer> sum_dyxhat,
                              ffi::Result<ffi::AnyBuffer> ws, double eps, int64_t relu) {
  View v;
  int64_t cap = 0;
  if (auto err = check_backward_reduce(dy, x, mask, mean, var, *sum_dy, *sum_dyxhat, *ws, eps, relu != 0,
                                       &v, &cap);
      err.failure())
    return err;
  if (v.groups * v.channels == 0) return ffi::Error::Success();
  return cuda_status(
      backward_reduce_cuda(stream, v, dy.untyped_data(), x.untyped_data(),
                           relu ? static_cast<const uint32_t*>(mask.untyped_data()) : nullptr,
                           mean.untyped_data(), var.untyped_data(), sum_dy->untyped_data(),
                           sum_dyxhat->untyped_data(), ws->untyped_data(), cap, eps, relu != 0),
      "batch_norm_bwd");
}

ffi::Error BackwardDxCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                          ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer var,
                          ffi::AnyBuffer sum_dy, ffi::AnyBuffer sum_dyxhat, ffi::AnyBuffer dmean,
                          ffi::AnyBuffer dvar, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> dres, ffi::Result<ffi::AnyBuffer> coef,
                          double eps, int64_t relu, int64_t has_residual, int64_t train,
                          int64_t count) {
  View v;
  const ffi::AnyBuffer* pc[7] = {&scale, &mean, &var, &sum_dy, &sum_dyxhat, &dmean, &dvar};
  if (auto err = check_backward_dx(dy, x, mask, pc, *dx, *dres, *coef, eps, relu != 0, has_residual != 0,
                                   count, &v);
      err.failure())
    return err;
  if (v.elements() == 0) return ffi::Error::Success();
  return cuda_status(
      backward_dx_cuda(stream, v, dy.untyped_data(), x.untyped_data(),
                       relu ? static_cast<const uint32_t*>(mask.untyped_data()) : nullptr, scale.untyped_data(),
                       mean.untyped_data(), var.untyped_data(), sum_dy.untyped_data(),
                       sum_dyxhat.untyped_data(), dmean.untyped_data(), dvar.untyped_data(), dx->untyped_data(),
                       has_residual ? dres->untyped_data() : nullptr, coef->untyped_data(), eps, relu != 0,
                       train != 0, count),
      "batch_norm_bwd");
}

// The training backward in one call: one cooperative kernel when dy and x come in 16-byte packs
// of channels (bn_backward_hybrid.cu), else the sums and dx kernels.
ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                        ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer dmean,
                        ffi::AnyBuffer dvar, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dres,
                        ffi::Result<ffi::AnyBuffer> sum_dy, ffi::Result<ffi::AnyBuffer> sum_dyxhat,
                        ffi::Result<ffi::AnyBuffer> ws, ffi::Result<ffi::AnyBuffer> coef, double eps,
                        int64_t relu, int64_t has_residual) {
  View v;
  int64_t cap = 0;
  if (auto err = check_backward(dy, x, mask, scale, mean, var, dmean, dvar, *dx, *dres, *sum_dy, *sum_dyxhat, *ws,
                                *coef, eps, relu != 0, has_residual != 0, &v, &cap);
      err.failure())
    return err;
  if (v.groups * v.channels == 0) return ffi::Error::Success();
  const uint32_t* bits = relu ? static_cast<const uint32_t*>(mask.untyped_data()) : nullptr;
  void* dr = has_residual ? dres->untyped_data() : nullptr;
  if (v.elements() > 0) {
    bool launched = false;
    if (cudaError_t err = hybrid_backward_cuda(stream, v, dy.untyped_data(), x.untyped_data(), bits,
                                               scale.untyped_data(), mean.untyped_data(), var.untyped_data(),
                                               dmean.untyped_data(), dvar.untyped_data(), dx->untyped_data(), dr,
                                               sum_dy->untyped_data(), sum_dyxhat->untyped_data(),
                                               ws->untyped_data(), cap, coef->untyped_data(), eps, &launched))
      return cuda_status(err, "batch_norm_bwd");
    if (launched) return ffi::Error::Success();
  }
  if (cudaError_t err = backward_reduce_cuda(stream, v, dy.untyped_data(), x.untyped_data(), bits,
                                             mean.untyped_data(), var.untyped_data(), sum_dy->untyped_data(),
                                             sum_dyxhat->untyped_data(), ws->untyped_data(), cap, eps, relu != 0))
    return cuda_status(err, "batch_norm_bwd");
  if (v.elements() == 0) return ffi::Error::Success();
  return cuda_status(backward_dx_cuda(stream, v, dy.untyped_data(), x.untyped_data(), bits, scale.untyped_data(),
                                      mean.untyped_data(), var.untyped_data(), sum_dy->untyped_data(),
                                      sum_dyxhat->untyped_data(), dmean.untyped_data(), dvar.untyped_data(),
                                      dx->untyped_data(), dr, coef->untyped_data(), eps, relu != 0, true, v.rows),
                     "batch_norm_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStatsCuda, StatsCuda,
                              bind_stats(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormApplyCuda, ApplyCuda,
                              bind_apply(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormForwardCuda, ForwardCuda,
                              bind_forward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardReduceCuda, BackwardReduceCuda,
                              bind_backward_reduce(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardDxCuda, BackwardDxCuda,
                              bind_backward_dx(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardCuda, BackwardCuda,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_bn_stats", BatchNormStatsCuda);
JAXOPS_REGISTER("jaxops_bn_apply", BatchNormApplyCuda);
JAXOPS_REGISTER("jaxops_bn_forward", BatchNormForwardCuda);
JAXOPS_REGISTER("jaxops_bn_bwd_reduce", BatchNormBackwardReduceCuda);
JAXOPS_REGISTER("jaxops_bn_bwd_dx", BatchNormBackwardDxCuda);
JAXOPS_REGISTER("jaxops_bn_backward", BatchNormBackwardCuda);

}  // namespace jaxops::batch_norm
