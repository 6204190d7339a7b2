// CPU FFI handlers for layer_norm / rms_norm, forward and backward.
#include <vector>

#include "common/cpu_parallel.h"
#include "common/registry.h"
#include "layer_norm/layer_norm_args.h"
#include "layer_norm/layer_norm_cpu.h"

namespace jaxops::layer_norm {
namespace {

// Rows are independent in the forward: each thread of XLA's pool takes whole ones.
void forward_parallel(ffi::ThreadPool& pool, const ForwardArgs& a) {
  cpu::parallel_for(pool, a.shape.rows, a.shape.cols, 1,
                    [&](int64_t r0, int64_t r1) { forward_cpu(a, r0, r1); });
}

// Each group's rows in cpu::row_parts ranges (the shape alone decides them, so dscale / dbias do
// not depend on the thread count), their dx and partial sums on the pool, then the sums added
// in order a group at a time.
void backward_parallel(ffi::ThreadPool& pool, const BackwardArgs& a) {
  const Shape& s = a.shape;
  const int64_t parts = backward_parts(s);
  const int64_t piece_cost = s.rows_per_group / parts * s.cols;
  if (parts == 1) {  // a group a piece: each writes its own dscale / dbias
    cpu::parallel_for(pool, s.groups, piece_cost, 1,
                      [&](int64_t g0, int64_t g1) { backward_cpu(a, 1, g0, g1, nullptr); });
    return;
  }
  std::vector<double> sums(2 * s.groups * parts * s.cols);
  cpu::parallel_for(pool, s.groups * parts, piece_cost, 1,
                    [&](int64_t i0, int64_t i1) { backward_cpu(a, parts, i0, i1, sums.data()); });
  cpu::parallel_for(pool, s.groups, parts * s.cols, 1,
                    [&](int64_t g0, int64_t g1) { store_param_grads_cpu(a, parts, g0, g1, sums.data()); });
}

ffi::Error LayerNormFwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(false, x, scale, &bias, *y, &*mean, *rstd, epsilon, &a); err.failure())
    return err;
  if (!is_empty(a.shape)) forward_parallel(pool, a);
  return ffi::Error::Success();
}

ffi::Error RmsNormFwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> rstd, double epsilon) {
  ForwardArgs a;
  if (auto err = check_forward(true, x, scale, nullptr, *y, nullptr, *rstd, epsilon, &a); err.failure())
    return err;
  if (!is_empty(a.shape)) forward_parallel(pool, a);
  return ffi::Error::Success();
}

ffi::Error LayerNormBwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                           ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(false, x, scale, &mean, rstd, dy, *dx, *dscale, &*dbias, *workspace, &a);
      err.failure())
    return err;
  if (!is_empty(a.shape)) backward_parallel(pool, a);
  return ffi::Error::Success();
}

ffi::Error RmsNormBwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer rstd,
                         ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  BackwardArgs a;
  if (auto err = check_backward(true, x, scale, nullptr, rstd, dy, *dx, *dscale, nullptr, *workspace, &a);
      err.failure())
    return err;
  if (!is_empty(a.shape)) backward_parallel(pool, a);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormForwardCpu, LayerNormFwdCpu,
                              bind_layer_norm_fwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormForwardCpu, RmsNormFwdCpu,
                              bind_rms_norm_fwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBackwardCpu, LayerNormBwdCpu,
                              bind_layer_norm_bwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBackwardCpu, RmsNormBwdCpu,
                              bind_rms_norm_bwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_layer_norm_fwd", LayerNormForwardCpu);
JAXOPS_REGISTER("jaxops_rms_norm_fwd", RmsNormForwardCpu);
JAXOPS_REGISTER("jaxops_layer_norm_bwd", LayerNormBackwardCpu);
JAXOPS_REGISTER("jaxops_rms_norm_bwd", RmsNormBackwardCpu);

}  // namespace jaxops::layer_norm
