// CPU FFI handlers for relu forward (y and the bit mask) and backward (dy and the mask).
#include "common/registry.h"
#include "relu/relu_args.h"
#include "relu/relu_cpu.h"

namespace jaxops::relu {
namespace {

ffi::Error ForwardCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                      int64_t with_mask) {
  View v;
  if (auto err = check_forward(x, *y, *mask, with_mask != 0, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  forward_cpu(v.dtype, x.untyped_data(), y->untyped_data(), static_cast<uint32_t*>(mask->untyped_data()),
              v.rows, v.cols, v.words_per_row);
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer dy, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dx) {
  View v;
  if (auto err = check_backward(dy, mask, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  backward_cpu(v.dtype, dy.untyped_data(), static_cast<const uint32_t*>(mask.untyped_data()),
               dx->untyped_data(), v.rows, v.cols, v.words_per_row);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluForwardCpu, ForwardCpu, bind_forward(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluBackwardCpu, BackwardCpu, bind_backward(ffi::Ffi::Bind()));
JAXOPS_REGISTER("jaxops_relu_fwd", ReluForwardCpu);
JAXOPS_REGISTER("jaxops_relu_bwd", ReluBackwardCpu);

}  // namespace jaxops::relu
