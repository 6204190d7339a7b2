// Launcher of the CUDA selection kernel (host code; kernels live in knn_select.cu).
#pragma once
#include <cuda_runtime_api.h>

#include "knn/knn_view.h"

namespace jaxops::knn {

// Largest k the CUDA kernel takes: the running list and the candidate buffer (2 x K keys of
// 8 bytes, K = k rounded up to a power of two) must fit the 48 KB of static shared memory.
constexpr int64_t kMaxCudaK = 2048;

cudaError_t select_cuda(const SelectView& v, const SelectBuffers& b, cudaStream_t stream);

}  // namespace jaxops::knn
