// Launchers of the batch_norm CUDA kernels (host side). Shapes follow bn_args.h: G groups of
// R x C, per-channel arrays (G, C) in the statistics dtype A (double for float64 x, else float).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "batch_norm/bn_view.h"

namespace jaxops::batch_norm {

// Channels one thread handles in the kernels that keep per-channel values in registers (the
// statistics and gradient partials of bn_reduce.cu, dx's coefficient records in
// bn_elementwise.cu): a 16-byte pack, except 4 channels (8 bytes) for 16-bit types. With 8
// 16-bit channels that per-channel state filled the register file (stats_partial 98 and
// grad_partial 123 registers in session 2, dx 70 in session 13: 2-3 blocks an SM, the loads
// waiting on DRAM); 4 halve it while a warp still requests 256 bytes a row.
template <class T>
constexpr int lane_channels() {
  return sizeof(T) == 2 ? 4 : 16 / static_cast<int>(sizeof(T));
}

// mean / biased var per channel: column partials (sum, Welford mean, M2 of x minus a per-channel
// pivot) per row block into `ws` ((G, cap, 3, C)), then a fixed-order Chan merge. Deterministic.
cudaError_t stats_cuda(cudaStream_t stream, const View& v, const void* x, void* mean, void* var, void* ws,
                       int64_t cap);

// y = (x - mean) * scale * invstd + bias (+ residual) (relu) and the mask when v.mask_words > 0.
// `coef` is a (G, 4, C) workspace for the per-channel coefficients.
cudaError_t apply_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                       const void* bias, const void* mean, const void* var, const void* residual, void* y,
                       uint32_t* mask, void* coef, double eps, bool relu);

// The whole training forward (statistics into mean/var, then y and the mask) in one cooperative
// kernel when one group's x fits in the GPU's shared memory (bn_resident.cu); ws is the stats
// workspace ((cap, 3, C)), coef a (4, C) float32 workspace. Sets *launched to false, launching
// nothing, for any other shape.
cudaError_t resident_forward_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                                  const void* bias, const void* residual, void* y, uint32_t* mask, void* mean,
                                  void* var, void* ws, int64_t cap, void* coef, double eps, bool relu,
                                  bool* launched);

// The same in one cooperative kernel for a larger x whose channels come in 16-byte packs, C / P a
// power of two (bn_hybrid.cu): a slice of rows stays in shared memory, the rest is read twice.
// coef is a (4, C) float32 workspace. Sets *launched to false, launching nothing, for any other shape.
cudaError_t hybrid_forward_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                                const void* bias, const void* residual, void* y, uint32_t* mask, void* mean,
                                void* var, void* ws, int64_t cap, void* coef, double eps, bool relu,
                                bool* launched);

// The training backward (sums, coefficients with count = rows, dx and dres) in one cooperative
// kernel whose channels come in 16-byte packs, C / P a power of two (bn_backward_hybrid.cu): a slice
// of dy's and x's rows stays in shared memory, the rest is read twice. ws is (cap, 2, C), coef a
// (4, C) float32 workspace. Sets *launched to false, launching nothing, for any other shape.
cudaError_t hybrid_backward_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                                 const uint32_t* mask, const void* scale, const void* mean, const void* var,
                                 const void* dmean, const void* dvar, void* dx, void* dres, void* sum_dy,
                                 void* sum_dyxhat, void* ws, int64_t cap, void* coef, double eps,
                                 bool* launched);

// sum_dy, sum_dyxhat per channel (dy masked by the relu bit when relu); ws is (G, cap, 2, C).
cudaError_t backward_reduce_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                                 const uint32_t* mask, const void* mean, const void* var, void* sum_dy,
                                 void* sum_dyxhat, void* ws, int64_t cap, double eps, bool relu);

// dx (and dres = dy' when dres is non-null) from per-channel coefficients (bn_math.h).
cudaError_t backward_dx_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                             const uint32_t* mask, const void* scale, const void* mean, const void* var,
                             const void* sum_dy, const void* sum_dyxhat, const void* dmean, const void* dvar,
                             void* dx, void* dres, void* coef, double eps, bool relu, bool train, int64_t count);

}  // namespace jaxops::batch_norm
