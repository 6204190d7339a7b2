// CPU FFI handlers of batch_norm: statistics, normalize(+add+relu), both fused, backward reduce,
// backward dx, both fused.
#include <algorithm>

#include "batch_norm/bn_args.h"
#include "batch_norm/bn_cpu.h"
#include "common/cpu_parallel.h"
#include "common/registry.h"

namespace jaxops::batch_norm {
namespace {

// The row-wise passes on XLA's pool: blocks of rows (whole mask words each) to each thread.
template <class Fn>
void for_row_blocks(ffi::ThreadPool& pool, const View& v, const Fn& fn) {
  const RowBlocks b = row_blocks(v, cpu::kParallelGrain / std::max<int64_t>(v.channels, 1));
  cpu::parallel_for(pool, v.groups * b.per_group, b.rows * v.channels, 1,
                    [&](int64_t u0, int64_t u1) { fn(b, u0, u1); });
}

ffi::Error StatsCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> mean,
                    ffi::Result<ffi::AnyBuffer> var, ffi::Result<ffi::AnyBuffer> ws) {
  View v;
  int64_t cap = 0;
  if (auto err = check_stats(x, *mean, *var, *ws, &v, &cap); err.failure()) return err;
  if (v.elements() == 0) return ffi::Error::Success();
  stats_cpu(v, x.untyped_data(), mean->untyped_data(), var->untyped_data(), cpu::on_pool(pool));
  return ffi::Error::Success();
}

ffi::Error ApplyCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
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
  for_row_blocks(pool, v, [&](const RowBlocks& b, int64_t u0, int64_t u1) {
    apply_cpu(v, x.untyped_data(), scale.untyped_data(), bias.untyped_data(), mean.untyped_data(),
              var.untyped_data(), has_residual ? residual.untyped_data() : nullptr, y->untyped_data(),
              static_cast<uint32_t*>(mask->untyped_data()), eps, relu != 0, b, u0, u1);
  });
  return ffi::Error::Success();
}

// The fused training forward's CPU twin: the statistics, then the apply, as two calls do.
ffi::Error ForwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                      ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                      ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> var,
                      ffi::Result<ffi::AnyBuffer> ws, ffi::Result<ffi::AnyBuffer> coef, double eps,
                      int64_t relu, int64_t with_mask, int64_t has_residual) {
  View v;
  int64_t cap = 0;
  if (auto err = check_forward(x, scale, bias, residual, *y, *mask, *mean, *var, *ws, *coef, eps, relu, with_mask,
                               has_residual, &v, &cap);
      err.failure())
    return err;
  if (v.elements() == 0) return ffi::Error::Success();
  stats_cpu(v, x.untyped_data(), mean->untyped_data(), var->untyped_data(), cpu::on_pool(pool));
  for_row_blocks(pool, v, [&](const RowBlocks& b, int64_t u0, int64_t u1) {
    apply_cpu(v, x.untyped_data(), scale.untyped_data(), bias.untyped_data(), mean->untyped_data(),
              var->untyped_data(), has_residual ? residual.untyped_data() : nullptr, y->untyped_data(),
              static_cast<uint32_t*>(mask->untyped_data()), eps, relu != 0, b, u0, u1);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardReduceCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                             ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::Result<ffi::AnyBuffer> sum_dy,
                             ffi::Result<ffi::AnyBuffer> sum_dyxhat, ffi::Result<ffi::AnyBuffer> ws, double eps,
                             int64_t relu) {
  View v;
  int64_t cap = 0;
  if (auto err = check_backward_reduce(dy, x, mask, mean, var, *sum_dy, *sum_dyxhat, *ws, eps, relu != 0,
                                       &v, &cap);
      err.failure())
    return err;
  if (v.groups * v.channels == 0) return ffi::Error::Success();
  backward_reduce_cpu(v, dy.untyped_data(), x.untyped_data(),
                      relu ? static_cast<const uint32_t*>(mask.untyped_data()) : nullptr, mean.untyped_data(),
                      var.untyped_data(), sum_dy->untyped_data(), sum_dyxhat->untyped_data(), eps, cpu::on_pool(pool));
  return ffi::Error::Success();
}

ffi::Error BackwardDxCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                         ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer sum_dy,
                         ffi::AnyBuffer sum_dyxhat, ffi::AnyBuffer dmean, ffi::AnyBuffer dvar,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dres,
                         ffi::Result<ffi::AnyBuffer> coef, double eps, int64_t relu, int64_t has_residual,
                         int64_t train, int64_t count) {
  View v;
  const ffi::AnyBuffer* pc[7] = {&scale, &mean, &var, &sum_dy, &sum_dyxhat, &dmean, &dvar};
  if (auto err = check_backward_dx(dy, x, mask, pc, *dx, *dres, *coef, eps, relu != 0, has_residual != 0,
                                   count, &v);
      err.failure())
    return err;
  if (v.elements() == 0) return ffi::Error::Success();
  for_row_blocks(pool, v, [&](const RowBlocks& b, int64_t u0, int64_t u1) {
    backward_dx_cpu(v, dy.untyped_data(), x.untyped_data(),
                    relu ? static_cast<const uint32_t*>(mask.untyped_data()) : nullptr, scale.untyped_data(),
                    mean.untyped_data(), var.untyped_data(), sum_dy.untyped_data(), sum_dyxhat.untyped_data(),
                    dmean.untyped_data(), dvar.untyped_data(), dx->untyped_data(),
                    has_residual ? dres->untyped_data() : nullptr, eps, train != 0, count, b, u0, u1);
  });
  return ffi::Error::Success();
}

// The training backward in one call: the sums, then dx, as the two calls do.
ffi::Error BackwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
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
  backward_reduce_cpu(v, dy.untyped_data(), x.untyped_data(), bits, mean.untyped_data(), var.untyped_data(),
                      sum_dy->untyped_data(), sum_dyxhat->untyped_data(), eps, cpu::on_pool(pool));
  if (v.elements() == 0) return ffi::Error::Success();
  for_row_blocks(pool, v, [&](const RowBlocks& b, int64_t u0, int64_t u1) {
    backward_dx_cpu(v, dy.untyped_data(), x.untyped_data(), bits, scale.untyped_data(), mean.untyped_data(),
                    var.untyped_data(), sum_dy->untyped_data(), sum_dyxhat->untyped_data(), dmean.untyped_data(),
                    dvar.untyped_data(), dx->untyped_data(), has_residual ? dres->untyped_data() : nullptr, eps,
                    true, v.rows, b, u0, u1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStatsCpu, StatsCpu, bind_stats(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormApplyCpu, ApplyCpu, bind_apply(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormForwardCpu, ForwardCpu, bind_forward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardReduceCpu, BackwardReduceCpu,
                              bind_backward_reduce(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardDxCpu, BackwardDxCpu,
                              bind_backward_dx(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBackwardCpu, BackwardCpu,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_bn_stats", BatchNormStatsCpu);
JAXOPS_REGISTER("jaxops_bn_apply", BatchNormApplyCpu);
JAXOPS_REGISTER("jaxops_bn_forward", BatchNormForwardCpu);
JAXOPS_REGISTER("jaxops_bn_bwd_reduce", BatchNormBackwardReduceCpu);
JAXOPS_REGISTER("jaxops_bn_bwd_dx", BatchNormBackwardDxCpu);
JAXOPS_REGISTER("jaxops_bn_backward", BatchNormBackwardCpu);

}  // namespace jaxops::batch_norm
