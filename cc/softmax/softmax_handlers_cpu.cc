// CPU FFI handlers for softmax / log_softmax, forward and backward.
#include "common/registry.h"
#include "softmax/softmax_args.h"
#include "softmax/softmax_cpu.h"

namespace jaxops::softmax {
namespace {

ffi::Error ForwardCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y,
                      int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_forward(x, mask, masked, *y, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  forward_cpu(v.dtype, x.untyped_data(), masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr,
              y->untyped_data(), v.rows, v.cols, log != 0);
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer mask,
                       ffi::Result<ffi::AnyBuffer> dx, int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_backward(y, dy, mask, masked, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  backward_cpu(v.dtype, y.untyped_data(), dy.untyped_data(),
               masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr, dx->untyped_data(),
               v.rows, v.cols, log != 0);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxForwardCpu, ForwardCpu, bind_forward(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBackwardCpu, BackwardCpu, bind_backward(ffi::Ffi::Bind()));
JAXOPS_REGISTER("jaxops_softmax_fwd", SoftmaxForwardCpu);
JAXOPS_REGISTER("jaxops_softmax_bwd", SoftmaxBackwardCpu);

}  // namespace jaxops::softmax
