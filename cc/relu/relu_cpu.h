// CPU twins of the relu kernels (same bit-mask layout as the CUDA kernels).
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace jaxops::relu {

// y = relu(x) (NaN stays NaN) for a rows x cols array; when words_per_row > 0 also writes the
// mask: bit j of word i of a row = (x[32*i+j] > 0).
bool forward_cpu(Dtype dtype, const void* x, void* y, uint32_t* mask, int64_t rows, int64_t cols,
                 int64_t words_per_row);

// dx = dy where the mask bit is set, else 0.
bool backward_cpu(Dtype dtype, const void* dy, const uint32_t* mask, void* dx, int64_t rows,
                  int64_t cols, int64_t words_per_row);

}  // namespace jaxops::relu
