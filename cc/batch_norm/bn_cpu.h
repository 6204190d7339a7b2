// CPU twins of the batch_norm kernels: same layout (G groups of R x C), same per-channel math
// (bn_math.h); statistics accumulate in float64.
#pragma once
#include <cstdint>

#include "batch_norm/bn_args.h"
#include "common/cpu_parts.h"

namespace jaxops::batch_norm {

using cpu::ForRanges;

// Per-channel mean and biased variance over the R rows of each group (two-pass, float64). The
// sums run over row ranges (cpu::row_parts: the shape alone decides them) on for_ranges, then
// each group's are added in order, so the result does not depend on the thread count.
void stats_cpu(const View& v, const void* x, void* mean, void* var, const ForRanges& for_ranges);

// The row-wise passes (apply, backward_dx) in blocks that threads can share: block u is rows
// [(u % per_group) rows, + rows) of group u / per_group (the group's last one shorter). `rows`
// times the channels is a multiple of 32, so each block writes whole mask words of its own.
struct RowBlocks {
  int64_t rows = 1;
  int64_t per_group = 1;
};
RowBlocks row_blocks(const View& v, int64_t min_rows);

// y = (x - mean) * scale / sqrt(var + eps) + bias (+ residual), then relu; mask when v.mask_words.
// Blocks [u0, u1).
void apply_cpu(const View& v, const void* x, const void* scale, const void* bias, const void* mean,
               const void* var, const void* residual, void* y, uint32_t* mask, double eps, bool relu,
               const RowBlocks& b, int64_t u0, int64_t u1);

// sum_dy = sum(dy'), sum_dyxhat = sum(dy' * xhat) per channel; dy' = dy masked by the relu bit.
// Summed over row ranges on for_ranges as stats_cpu's are.
void backward_reduce_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                         const void* mean, const void* var, void* sum_dy, void* sum_dyxhat, double eps,
                         const ForRanges& for_ranges);

// dx (and dresidual = dy' when dres is non-null), see backward_coef in bn_math.h. Blocks [u0, u1).
void backward_dx_cpu(const View& v, const void* dy, const void* x, const uint32_t* mask,
                     const void* scale, const void* mean, const void* var, const void* sum_dy,
                     const void* sum_dyxhat, const void* dmean, const void* dvar, void* dx, void* dres,
                     double eps, bool train, int64_t count, const RowBlocks& b, int64_t u0, int64_t u1);

}  // namespace jaxops::batch_norm
