// CPU FFI handlers for relu forward (y and the bit mask) and backward (dy and the mask).
#include "common/cpu_parallel.h"
#include "common/registry.h"
#include "relu/relu_args.h"
#include "relu/relu_cpu.h"

namespace jaxops::relu {
namespace {

// Each thread of XLA's pool takes whole rows, or, for the one flat row the Python side passes
// outside vmap, runs of 32-element multiples: whole mask words of their own either way.
template <class Fn>
void for_segments(ffi::ThreadPool& pool, const View& v, const Fn& fn) {
  if (v.rows == 1) {
    cpu::parallel_for(pool, v.cols, 1, 32, [&](int64_t e0, int64_t e1) {
      fn(e0, v.words_per_row ? e0 / 32 : 0, int64_t{1}, e1 - e0, v.words_per_row ? (e1 - e0 + 31) / 32 : 0);
    });
  } else {
    cpu::parallel_for(pool, v.rows, v.cols, 1, [&](int64_t r0, int64_t r1) {
      fn(r0 * v.cols, r0 * v.words_per_row, r1 - r0, v.cols, v.words_per_row);
    });
  }
}

ffi::Error ForwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> mask, int64_t with_mask) {
  View v;
  if (auto err = check_forward(x, *y, *mask, with_mask != 0, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  const int64_t size = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const auto* xs = static_cast<const char*>(x.untyped_data());
  auto* ys = static_cast<char*>(y->untyped_data());
  auto* words = static_cast<uint32_t*>(mask->untyped_data());
  for_segments(pool, v, [&](int64_t e0, int64_t w0, int64_t rows, int64_t cols, int64_t wpr) {
    forward_cpu(v.dtype, xs + e0 * size, ys + e0 * size, words + w0, rows, cols, wpr);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer mask,
                       ffi::Result<ffi::AnyBuffer> dx) {
  View v;
  if (auto err = check_backward(dy, mask, *dx, &v); err.failure()) return err;
  if (v.rows * v.cols == 0) return ffi::Error::Success();
  const int64_t size = static_cast<int64_t>(ffi::ByteWidth(dy.element_type()));
  const auto* gs = static_cast<const char*>(dy.untyped_data());
  const auto* words = static_cast<const uint32_t*>(mask.untyped_data());
  auto* out = static_cast<char*>(dx->untyped_data());
  for_segments(pool, v, [&](int64_t e0, int64_t w0, int64_t rows, int64_t cols, int64_t wpr) {
    backward_cpu(v.dtype, gs + e0 * size, words + w0, out + e0 * size, rows, cols, wpr);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluForwardCpu, ForwardCpu, bind_forward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReluBackwardCpu, BackwardCpu, bind_backward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_relu_fwd", ReluForwardCpu);
JAXOPS_REGISTER("jaxops_relu_bwd", ReluBackwardCpu);

}  // namespace jaxops::relu
