// CUDA FFI handler of jaxops_knn_select (the XLA dot runs before it, in JAX).
#include <string>

#include "common/cuda_status.h"
#include "common/registry.h"
#include "knn/knn_args.h"
#include "knn/knn_select_cuda.h"

namespace jaxops::knn {
namespace {

ffi::Error SelectCudaImpl(cudaStream_t stream, ffi::AnyBuffer tile, ffi::AnyBuffer qn,
                          ffi::AnyBuffer rn, ffi::AnyBuffer prev_d, ffi::AnyBuffer prev_i,
                          ffi::AnyBuffer base, ffi::Result<ffi::AnyBuffer> out_d,
                          ffi::Result<ffi::AnyBuffer> out_i, int64_t n, int64_t mode) {
  SelectView v;
  if (auto err = check_select(tile, qn, rn, prev_d, prev_i, base, *out_d, *out_i, n, mode, &v);
      err.failure())
    return err;
  if (v.k > kMaxCudaK)
    return invalid_argument("knn", "the CUDA selection kernel takes k <= " +
                                       std::to_string(kMaxCudaK) + ", got " + std::to_string(v.k));
  if (v.batch * v.rows > INT32_MAX)
    return invalid_argument("knn", "too many query rows in one tile");
  if (v.batch * v.rows == 0) return ffi::Error::Success();
  SelectBuffers b{static_cast<const float*>(tile.untyped_data()),
                  static_cast<const float*>(qn.untyped_data()),
                  static_cast<const float*>(rn.untyped_data()),
                  static_cast<const float*>(prev_d.untyped_data()),
                  static_cast<const int32_t*>(prev_i.untyped_data()),
                  static_cast<const int32_t*>(base.untyped_data()),
                  static_cast<float*>(out_d->untyped_data()),
                  static_cast<int32_t*>(out_i->untyped_data())};
  return cuda_status(select_cuda(v, b, stream), "knn");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KnnSelectCuda, SelectCudaImpl,
                              bind_select(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JAXOPS_REGISTER("jaxops_knn_select", KnnSelectCuda);

}  // namespace jaxops::knn
