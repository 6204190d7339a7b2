// CPU FFI handler of every reduction (sum, mean, max, min, logsumexp, argmax, argmin).
#include <algorithm>
#include <atomic>

#include "common/cpu_parallel.h"
#include "common/registry.h"
#include "reduce/reduce_args.h"
#include "reduce/reduce_cpu.h"

namespace jaxops::reduce {
namespace {

// The outer slices (x[o] of reduced x inner elements, y[o] of inner results) are independent:
// each thread of XLA's pool takes whole ones. When there are fewer slices than threads (the
// columns of a matrix, the whole array), each slice is split instead (reduce_slice_cpu: the same
// answer, so the thread count never changes it).
ffi::Error ReduceCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t op, int64_t splits) {
  View v;
  if (auto err = check_reduce(x, *y, *ws, op, splits, &v); err.failure()) return err;
  if (v.outer * v.inner == 0) return ffi::Error::Success();
  const int64_t in_slice = v.reduced * v.inner * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const int64_t out_slice = static_cast<int64_t>(y->size_bytes()) / v.outer;
  const auto* xs = static_cast<const char*>(x.untyped_data());
  auto* ys = static_cast<char*>(y->untyped_data());
  std::atomic<bool> ok{true};
  if (v.outer < cpu::thread_cap(pool.num_threads())) {
    const cpu::ForRanges ranges = cpu::on_pool(pool);
    for (int64_t o = 0; o < v.outer; ++o)
      if (!reduce_slice_cpu(v.kind, v.dtype, xs + o * in_slice, ys + o * out_slice, v.reduced, v.inner, ranges))
        ok.store(false);
  } else {
    // (cost in logsumexp-equivalent elements: a chunk holds at least reduce_grain elements)
    const int64_t cost = v.reduced * v.inner * cpu::kParallelGrain / reduce_grain(v.kind);
    cpu::parallel_for(pool, v.outer, std::max<int64_t>(cost, 1), 1, [&](int64_t o0, int64_t o1) {
      if (!reduce_cpu(v.kind, v.dtype, xs + o0 * in_slice, ys + o0 * out_slice, o1 - o0, v.reduced, v.inner))
        ok.store(false, std::memory_order_relaxed);
    });
  }
  if (!ok.load()) return invalid_argument(op_name(v.kind), "unsupported dtype");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceCpu, ReduceCpuImpl, bind_reduce(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_reduce", ReduceCpu);

}  // namespace jaxops::reduce
