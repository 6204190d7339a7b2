// CPU twins of the softmax kernels: the same formulas, row by row, float32 accumulation.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace jaxops::softmax {

// y = softmax(x) or log_softmax(x) over the last axis of a rows x cols array; mask may be null.
bool forward_cpu(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows, int64_t cols,
                 bool log);

// dx from y and dy: softmax dx = y (dy - sum(dy y)); log_softmax dx = dy - exp(y) sum(dy).
bool backward_cpu(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx,
                  int64_t rows, int64_t cols, bool log);

}  // namespace jaxops::softmax
