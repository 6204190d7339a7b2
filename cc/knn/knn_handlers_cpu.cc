// CPU FFI handler of jaxops_knn_select (the XLA dot runs before it, in JAX).
#include "common/cpu_parallel.h"
#include "common/registry.h"
#include "knn/knn_args.h"
#include "knn/knn_select.h"

namespace jaxops::knn {
namespace {

ffi::Error SelectCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer tile, ffi::AnyBuffer qn, ffi::AnyBuffer rn,
                         ffi::AnyBuffer prev_d, ffi::AnyBuffer prev_i, ffi::AnyBuffer base,
                         ffi::Result<ffi::AnyBuffer> out_d, ffi::Result<ffi::AnyBuffer> out_i,
                         int64_t n, int64_t mode) {
  SelectView v;
  if (auto err = check_select(tile, qn, rn, prev_d, prev_i, base, *out_d, *out_i, n, mode, &v);
      err.failure())
    return err;
  if (v.batch * v.rows == 0) return ffi::Error::Success();
  SelectBuffers b{static_cast<const float*>(tile.untyped_data()),
                  static_cast<const float*>(qn.untyped_data()),
                  static_cast<const float*>(rn.untyped_data()),
                  static_cast<const float*>(prev_d.untyped_data()),
                  static_cast<const int32_t*>(prev_i.untyped_data()),
                  static_cast<const int32_t*>(base.untyped_data()),
                  static_cast<float*>(out_d->untyped_data()),
                  static_cast<int32_t*>(out_i->untyped_data())};
  // Query rows are independent: each thread of XLA's pool takes whole ones.
  cpu::parallel_for(pool, v.batch * v.rows, v.cols, 1,
                    [&](int64_t r0, int64_t r1) { select_cpu(v, b, r0, r1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KnnSelectCpu, SelectCpuImpl, bind_select(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
JAXOPS_REGISTER("jaxops_knn_select", KnnSelectCpu);

}  // namespace jaxops::knn
