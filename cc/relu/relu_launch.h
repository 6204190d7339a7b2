// Launchers of the relu CUDA kernels (host side; kernels in relu.cu).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace jaxops::relu {

// y = relu(x) for a rows x cols array and, when words_per_row > 0, the bit mask (x > 0).
cudaError_t forward_cuda(cudaStream_t stream, Dtype dtype, const void* x, void* y, uint32_t* mask,
                         int64_t rows, int64_t cols, int64_t words_per_row);

// dx = mask ? dy : 0.
cudaError_t backward_cuda(cudaStream_t stream, Dtype dtype, const void* dy, const uint32_t* mask,
                          void* dx, int64_t rows, int64_t cols, int64_t words_per_row);

}  // namespace jaxops::relu
