// Sizes and pointers of one selection call, shared by the handlers, the CPU twin and the CUDA
// launcher (no FFI headers, so nvcc never sees them).
#pragma once
#include <cstdint>

namespace jaxops::knn {

// One call merges a tile of `cols` reference columns into the running top-k of `rows` queries,
// for `batch` independent problems (vmap's leading dimensions).
struct SelectView {
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t k = 0;
  int64_t n = 0;            // total references: tile column c is reference base + c, valid below n
  bool distances = false;   // tile holds clamped distances (mode 1) instead of inner products
  bool base_per_batch = false;
};

struct SelectBuffers {
  const float* tile;     // (batch, rows, cols) inner products q.r (mode 0) or distances (mode 1)
  const float* qn;       // (batch, rows) squared query norms (unused in mode 1)
  const float* rn;       // (batch, cols) squared reference norms (unused in mode 1)
  const float* prev_d;   // (batch, rows, k) running list, ascending by key
  const int32_t* prev_i;
  const int32_t* base;   // reference index of tile column 0, per batch entry or one for all
  float* out_d;          // (batch, rows, k) merged list
  int32_t* out_i;
};

}  // namespace jaxops::knn
