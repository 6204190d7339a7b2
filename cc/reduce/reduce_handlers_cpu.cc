// CPU FFI handler of every reduction (sum, mean, max, min, logsumexp, argmax, argmin).
#include "common/registry.h"
#include "reduce/reduce_args.h"
#include "reduce/reduce_cpu.h"

namespace jaxops::reduce {
namespace {

ffi::Error ReduceCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> ws, int64_t op, int64_t splits) {
  View v;
  if (auto err = check_reduce(x, *y, *ws, op, splits, &v); err.failure()) return err;
  if (v.outer * v.inner == 0) return ffi::Error::Success();
  if (!reduce_cpu(v.kind, v.dtype, x.untyped_data(), y->untyped_data(), v.outer, v.reduced, v.inner))
    return invalid_argument(op_name(v.kind), "unsupported dtype");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceCpu, ReduceCpuImpl, bind_reduce(ffi::Ffi::Bind()));
JAXOPS_REGISTER("jaxops_reduce", ReduceCpu);

}  // namespace jaxops::reduce
