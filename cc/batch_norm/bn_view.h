// The (G, R, C) view every batch_norm kernel works on (plain C++, no FFI headers, so nvcc
// sources include it cheaply).
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace jaxops::batch_norm {

struct View {
  int64_t groups = 0, rows = 0, channels = 0;
  int64_t mask_words = 0;  // per group; 0 when no mask is read or written
  Dtype dtype = Dtype::kInvalid;
  bool f64 = false;  // statistics dtype is float64
  int64_t elements_per_group() const { return rows * channels; }
  int64_t elements() const { return groups * rows * channels; }
};

}  // namespace jaxops::batch_norm
