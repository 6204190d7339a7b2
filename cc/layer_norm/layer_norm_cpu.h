// CPU twins of the layer_norm / rms_norm kernels: the same formulas row by row, float32
// statistics (float64 for float64 inputs), parameter gradients summed in a fixed row order.
#pragma once
#include "layer_norm/layer_norm_params.h"

namespace jaxops::layer_norm {

// y = (x - mean) * rstd * scale + bias (layer_norm) or x * rstd * scale (rms_norm); writes the
// per-row mean (layer_norm only) and rstd. False for an unsupported dtype.
bool forward_cpu(const ForwardArgs& a);

// dx, dscale (and dbias) from x, the saved statistics and dy. The CPU needs no workspace.
bool backward_cpu(const BackwardArgs& a);

}  // namespace jaxops::layer_norm
