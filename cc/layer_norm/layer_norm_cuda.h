// Launchers of the CUDA layer_norm / rms_norm kernels (host-callable; kernels live in
// layer_norm_fwd.cu and layer_norm_bwd.cu). They only enqueue work on `stream`.
#pragma once
#include <cuda_runtime_api.h>

#include "layer_norm/layer_norm_params.h"

namespace jaxops::layer_norm {

// y (and the per-row mean for layer_norm, rstd) from x, scale (and bias).
cudaError_t forward_cuda(const ForwardArgs& a, cudaStream_t stream);

// dx per row, per-slot partial column sums into the workspace, then dscale (and dbias).
cudaError_t backward_cuda(const BackwardArgs& a, cudaStream_t stream);

}  // namespace jaxops::layer_norm
