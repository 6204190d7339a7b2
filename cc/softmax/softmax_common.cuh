// Pieces every softmax kernel path shares: tile constants, float32/float64 exp and log, the row
// statistics the forward output needs, and masked outputs.
#pragma once
#include <cuda_runtime.h>

#include <cmath>

#include "common/cuda_util.cuh"
#include "softmax/softmax_math.cuh"

namespace jaxops::softmax {

using namespace jaxops::cuda;

constexpr int kWarpMaxCols = 1024;
constexpr int kWarpBlockThreads = 128;
constexpr size_t kCachedBytesPerBlock = 32 * 1024;  // leaves room for several blocks per SM
constexpr int kUnroll = 4;  // independent 16-byte loads each thread keeps in flight

template <class A> __device__ __forceinline__ A neg_inf() { return -A(INFINITY); }

__device__ __forceinline__ float fast_exp(float v) { return __expf(v); }
__device__ __forceinline__ double fast_exp(double v) { return exp(v); }
__device__ __forceinline__ float log_of(float v) { return logf(v); }
__device__ __forceinline__ double log_of(double v) { return log(v); }

// MaxOp with the one-instruction NaN-propagating max.
struct MaxNanOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return max_nan(a, b); }
  template <class A> __device__ __forceinline__ static A identity() { return -A(INFINITY); }
};

template <class A>
struct RowStats {  // what the forward output needs of its row
  A max, inv_sum, log_sum;
  // Only the statistic the output needs: the log costs ~20 instructions a row, which narrow
  // warp rows (16 values a lane) would otherwise pay on every softmax row.
  __device__ __forceinline__ RowStats(A m, A s, bool log)
      : max(m), inv_sum(log ? A(0) : A(1) / s), log_sum(log ? log_of(s) : A(0)) {}
  __device__ __forceinline__ A out(A v, bool log) const {
    return log ? (v - max) - log_sum : fast_exp(v - max) * inv_sum;
  }
};

template <class A>
__device__ __forceinline__ A masked_out(bool log) {
  return log ? neg_inf<A>() : A(0);
}

}  // namespace jaxops::softmax
