// CPU twins of the batch_norm kernels: same layout (G groups of R x C), same per-channel math
// (bn_math.h); statistics accumulate in float64.
#pragma once
#include <cstdint>

#include "batch_norm/bn_args.h"

namespace jaxops::batch_norm {

// Per-channel mean and biased variance over the R rows of each group (two-pass, float64).
void stats_cpu(const View& v, const void* x, void* mean, void* var);

// y = (x - mean) * scale / sqrt(var + eps) + bias (+ residual), then relu; mask when v.mask_words.
void apply_cpu(const View& v, const void* x, const void* scale, const void* bias, const void* mean,
               const void* var, const void* residual, void* y, uint32_t* mask, double eps, bool relu);

// sum_dy = sum(dy'), sum_dyxhat = sum(dy' * xhat) per channel; dy' = dy masked by the relu bit.
void backward_reduce_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                         const void* mean, const void* var, void* sum_dy, void* sum_dyxhat, double eps);

// dx (and dresidual = dy' when dres is non-null), see backward_coef in bn_math.h.
void backward_dx_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                     const void* scale, const void* mean, const void* var, const void* sum_dy,
                     const void* sum_dyxhat, const void* dmean, const void* dvar, void* dx, void* dres,
                     double eps, bool train, int64_t count);

}  // namespace jaxops::batch_norm
