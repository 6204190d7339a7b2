// Launchers of the CUDA softmax kernels (host-callable; dispatch in softmax_forward.cu and
// softmax_backward.cu, kernels in softmax_*.cuh).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace jaxops::softmax {

// y = softmax(x) or log_softmax(x) over the last axis of rows x cols; mask may be null.
cudaError_t forward_cuda(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows,
                         int64_t cols, bool log, cudaStream_t stream);

// dx from y and dy (softmax: y (dy - sum(y dy)); log_softmax: dx = dy - exp(y) sum(dy)).
cudaError_t backward_cuda(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx,
                          int64_t rows, int64_t cols, bool log, cudaStream_t stream);

}  // namespace jaxops::softmax
