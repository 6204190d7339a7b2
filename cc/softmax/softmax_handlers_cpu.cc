// CPU FFI handlers for softmax / log_softmax, forward and backward.
#include "common/cpu_parallel.h"
#include "common/registry.h"
#include "softmax/softmax_args.h"
#include "softmax/softmax_cpu.h"

namespace jaxops::softmax {
namespace {

// Rows are independent: each thread of XLA's pool takes whole ones.
ffi::Error ForwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                      ffi::Result<ffi::AnyBuffer> y, int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_forward(x, mask, masked, *y, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  const int64_t row = v.cols * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const auto* xs = static_cast<const char*>(x.untyped_data());
  const bool* keep = masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr;
  auto* ys = static_cast<char*>(y->untyped_data());
  cpu::parallel_for(pool, v.rows, v.cols, 1, [&](int64_t r0, int64_t r1) {
    forward_cpu(v.dtype, xs + r0 * row, keep ? keep + r0 * v.cols : nullptr, ys + r0 * row, r1 - r0, v.cols,
                log != 0);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer mask,
                       ffi::Result<ffi::AnyBuffer> dx, int64_t log, int64_t masked) {
  RowsView v;
  if (auto err = check_backward(y, dy, mask, masked, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  const int64_t row = v.cols * static_cast<int64_t>(ffi::ByteWidth(y.element_type()));
  const auto* ys = static_cast<const char*>(y.untyped_data());
  const auto* gs = static_cast<const char*>(dy.untyped_data());
  const bool* keep = masked ? static_cast<const bool*>(mask.untyped_data()) : nullptr;
  auto* out = static_cast<char*>(dx->untyped_data());
  cpu::parallel_for(pool, v.rows, v.cols, 1, [&](int64_t r0, int64_t r1) {
    backward_cpu(v.dtype, ys + r0 * row, gs + r0 * row, keep ? keep + r0 * v.cols : nullptr, out + r0 * row,
                 r1 - r0, v.cols, log != 0);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxForwardCpu, ForwardCpu, bind_forward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBackwardCpu, BackwardCpu, bind_backward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_softmax_fwd", SoftmaxForwardCpu);
JAXOPS_REGISTER("jaxops_softmax_bwd", SoftmaxBackwardCpu);

}  // namespace jaxops::softmax
