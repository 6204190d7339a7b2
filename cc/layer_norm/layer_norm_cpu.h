// CPU twins of the layer_norm / rms_norm kernels: the same formulas row by row, float32
// statistics (float64 for float64 inputs), parameter gradients summed in a fixed row order.
#pragma once
#include <cstdint>

#include "layer_norm/layer_norm_params.h"

namespace jaxops::layer_norm {

// Rows [r0, r1) of y = (x - mean) * rstd * scale + bias (layer_norm) or x * rstd * scale
// (rms_norm); writes their mean (layer_norm only) and rstd. False for an unsupported dtype.
bool forward_cpu(const ForwardArgs& a, int64_t r0, int64_t r1);

// The backward in pieces that threads can share. Each group's rows are split into
// `parts` = backward_parts(shape) consecutive ranges (cpu::row_parts: the shape alone decides).
// Piece i = g * parts + p writes dx of its rows and the double sums of their dscale / dbias
// terms to sums[2 i n, 2 i n + n) / [(2 i + 1) n, (2 i + 2) n) (n = cols). backward_cpu runs
// pieces [i0, i1); store_param_grads_cpu then adds each group's parts in order into dscale (and
// dbias) for groups [g0, g1), so the result does not depend on which thread ran what. With one
// part a group, sums may be null: each piece then writes its group's dscale / dbias itself. The
// CPU needs no workspace.
int64_t backward_parts(const Shape& s);
bool backward_cpu(const BackwardArgs& a, int64_t parts, int64_t i0, int64_t i1, double* sums);
bool store_param_grads_cpu(const BackwardArgs& a, int64_t parts, int64_t g0, int64_t g1, const double* sums);

}  // namespace jaxops::layer_norm
