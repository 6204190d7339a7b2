// Plain-data descriptions of one layer_norm / rms_norm call, shared by the CPU twin, the CUDA
// launchers and the handlers (no FFI or CUDA headers, so nvcc and host C++ both include it).
#pragma once
#include <cstdint>

#include "common/dtype.h"

#ifdef __CUDACC__
#define JAXOPS_LN_HD __host__ __device__
#else
#define JAXOPS_LN_HD
#endif

namespace jaxops::layer_norm {

// x is rows x cols (normalized over cols). scale/bias hold `groups` rows of cols: under
// jax.vmap (vmap_method="broadcast_all") each batch element may carry its own scale, so row r
// uses scale row r / rows_per_group. Without vmap, groups == 1.
struct Shape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t groups = 1;
  int64_t rows_per_group = 0;
  double epsilon = 0.0;  // float64 attribute, so float64 inputs see the exact value
  bool rms = false;  // rms_norm: no mean subtraction, no bias
};

// Statistics (mean, rstd), workspace and reductions use float32 for float32/bfloat16/float16
// and float64 for float64 inputs.
inline Dtype stats_dtype(Dtype x) { return x == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32; }

struct ForwardArgs {
  Shape shape;
  Dtype dtype = Dtype::kInvalid;
  const void* x = nullptr;
  const void* scale = nullptr;
  const void* bias = nullptr;  // null for rms_norm
  void* y = nullptr;
  void* mean = nullptr;        // null for rms_norm
  void* rstd = nullptr;
};

// The backward writes dx per row and, per "slot" (a contiguous run of rows inside one group),
// the column partial sums of dy * xhat (and dy) into workspace[groups][slots_per_group][nacc][cols];
// a second pass adds the first `slots_used` slots of each group in a fixed order, so the
// parameter gradients are bit-reproducible (no float atomics).
struct BackwardArgs {
  Shape shape;
  Dtype dtype = Dtype::kInvalid;
  const void* x = nullptr;
  const void* scale = nullptr;
  const void* mean = nullptr;  // null for rms_norm
  const void* rstd = nullptr;
  const void* dy = nullptr;
  void* dx = nullptr;
  void* dscale = nullptr;
  void* dbias = nullptr;       // null for rms_norm
  void* workspace = nullptr;
  int64_t slots_per_group = 0;  // slots the workspace holds per group
  float inv_cols = 0.0f;        // 1 / cols: read from the kernel parameters, not held in a register
};

// Number of accumulated column sums: dscale (and dbias for layer_norm).
JAXOPS_LN_HD inline int num_acc(bool rms) { return rms ? 1 : 2; }

// Rows [begin, end) of slot `j` of group `g` when a group's rows are split into `used` slots.
JAXOPS_LN_HD inline void slot_rows(const Shape& s, int64_t g, int64_t j, int64_t used, int64_t* begin, int64_t* end) {
  const int64_t chunk = (s.rows_per_group + used - 1) / used;
  int64_t b = j * chunk, e = b + chunk;
  if (b > s.rows_per_group) b = s.rows_per_group;
  if (e > s.rows_per_group) e = s.rows_per_group;
  *begin = g * s.rows_per_group + b;
  *end = g * s.rows_per_group + e;
}

}  // namespace jaxops::layer_norm
