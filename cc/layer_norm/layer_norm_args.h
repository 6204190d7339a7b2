// Argument checks shared by the CPU and CUDA layer_norm / rms_norm handlers: both validate the
// same way, and return an FFI error naming the op, before touching memory.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_util.h"
#include "layer_norm/layer_norm_params.h"

namespace jaxops::layer_norm {

// Nothing to compute (the Python wrapper never calls the kernels on empty arrays).
inline bool is_empty(const Shape& s) { return s.rows == 0 || s.cols == 0 || s.groups == 0; }

inline const char* op_name(bool rms, bool backward) {
  if (rms) return backward ? "rms_norm_bwd" : "rms_norm";
  return backward ? "layer_norm_bwd" : "layer_norm";
}

inline bool dtype_is(const ffi::AnyBuffer& b, Dtype d) { return to_dtype(b.element_type()) == d; }

// x: float, rank >= 1, last dim cols. scale: x's dtype, shape (batch..., cols) where batch...
// is a prefix of x's leading dims (empty without vmap). Fills everything in `s` but epsilon.
inline ffi::Error check_x_scale(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                bool rms, Shape* s, Dtype* dtype) {
  if (auto err = require_float(op, x, dtype); err.failure()) return err;
  auto xd = x.dimensions(), sd = scale.dimensions();
  if (xd.size() == 0) return invalid_argument(op, "x must have at least one dimension");
  if (!dtype_is(scale, *dtype)) return invalid_argument(op, "scale must have x's dtype");
  if (sd.size() == 0 || sd.size() > xd.size() || sd[sd.size() - 1] != xd[xd.size() - 1])
    return invalid_argument(op, "scale must have shape (x.shape[-1],)");
  for (size_t i = 0; i + 1 < sd.size(); ++i)
    if (sd[i] != xd[i]) return invalid_argument(op, "scale's batch dimensions must lead x's");
  s->cols = xd[xd.size() - 1];
  s->rows = dims_product(xd, 0, xd.size() - 1);
  s->groups = dims_product(sd, 0, sd.size() - 1);
  s->rows_per_group = s->groups > 0 ? s->rows / s->groups : 0;
  s->rms = rms;
  return ffi::Error::Success();
}

inline ffi::Error check_like(const char* op, const ffi::AnyBuffer& ref, const ffi::AnyBuffer& b,
                             const char* what, const char* ref_name) {
  if (b.element_type() != ref.element_type() || !same_dims(ref, b))
    return invalid_argument(op, std::string(what) + " must match " + ref_name + "'s shape and dtype");
  return ffi::Error::Success();
}

// Per-row statistics: `rows` values of the statistics dtype.
inline ffi::Error check_stats(const char* op, const ffi::AnyBuffer& b, const Shape& s, Dtype dtype,
                              const char* what) {
  if (!dtype_is(b, stats_dtype(dtype)) || static_cast<int64_t>(b.element_count()) != s.rows)
    return invalid_argument(op, std::string(what) + " must hold one " + dtype_name(stats_dtype(dtype)) +
                                    " per row");
  return ffi::Error::Success();
}

inline ffi::Error check_forward(bool rms, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                const ffi::AnyBuffer* bias, const ffi::AnyBuffer& y,
                                const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd, double epsilon,
                                ForwardArgs* a) {
  const char* op = op_name(rms, false);
  if (auto err = check_x_scale(op, x, scale, rms, &a->shape, &a->dtype); err.failure()) return err;
  if (!(epsilon >= 0.0)) return invalid_argument(op, "epsilon must be >= 0, got " + std::to_string(epsilon));
  a->shape.epsilon = epsilon;
  if (bias) {
    if (auto err = check_like(op, scale, *bias, "bias", "scale"); err.failure()) return err;
  }
  if (auto err = check_like(op, x, y, "the output", "x"); err.failure()) return err;
  if (mean) {
    if (auto err = check_stats(op, *mean, a->shape, a->dtype, "mean"); err.failure()) return err;
  }
  if (auto err = check_stats(op, rstd, a->shape, a->dtype, "rstd"); err.failure()) return err;
  a->x = x.untyped_data();
  a->scale = scale.untyped_data();
  a->bias = bias ? bias->untyped_data() : nullptr;
  a->y = y.untyped_data();
  a->mean = mean ? mean->untyped_data() : nullptr;
  a->rstd = rstd.untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error check_backward(bool rms, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                 const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd,
                                 const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx,
                                 const ffi::AnyBuffer& dscale, const ffi::AnyBuffer* dbias,
                                 const ffi::AnyBuffer& workspace, BackwardArgs* a) {
  const char* op = op_name(rms, true);
  if (auto err = check_x_scale(op, x, scale, rms, &a->shape, &a->dtype); err.failure()) return err;
  if (mean) {
    if (auto err = check_stats(op, *mean, a->shape, a->dtype, "mean"); err.failure()) return err;
  }
  if (auto err = check_stats(op, rstd, a->shape, a->dtype, "rstd"); err.failure()) return err;
  if (auto err = check_like(op, x, dy, "the cotangent", "x"); err.failure()) return err;
  if (auto err = check_like(op, x, dx, "dx", "x"); err.failure()) return err;
  if (auto err = check_like(op, scale, dscale, "dscale", "scale"); err.failure()) return err;
  if (dbias) {
    if (auto err = check_like(op, scale, *dbias, "dbias", "scale"); err.failure()) return err;
  }
  // workspace: (batch..., slots, nacc, cols) of the statistics dtype.
  auto wd = workspace.dimensions();
  const Shape& s = a->shape;
  const int64_t per_slot = num_acc(rms) * s.cols;
  const int64_t n = static_cast<int64_t>(workspace.element_count());
  if (is_empty(s)) return ffi::Error::Success();  // nothing will be touched
  if (!dtype_is(workspace, stats_dtype(a->dtype)) || wd.size() < 3 || wd[wd.size() - 1] != s.cols ||
      wd[wd.size() - 2] != num_acc(rms) || n % (s.groups * per_slot) != 0 ||
      n / (s.groups * per_slot) < 1)
    return invalid_argument(op, "workspace must have shape (..., slots, " + std::to_string(num_acc(rms)) +
                                    ", cols) of the statistics dtype with slots >= 1 per group");
  a->slots_per_group = n / (s.groups * per_slot);
  a->inv_cols = 1.0f / static_cast<float>(s.cols);
  a->x = x.untyped_data();
  a->scale = scale.untyped_data();
  a->mean = mean ? mean->untyped_data() : nullptr;
  a->rstd = rstd.untyped_data();
  a->dy = dy.untyped_data();
  a->dx = dx.untyped_data();
  a->dscale = dscale.untyped_data();
  a->dbias = dbias ? dbias->untyped_data() : nullptr;
  a->workspace = workspace.untyped_data();
  return ffi::Error::Success();
}

// FFI signature of each target, written once so the CPU and CUDA handlers cannot disagree:
// operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.

// jaxops_layer_norm_fwd: x, scale, bias -> y, mean, rstd.
template <class Binding>
auto bind_layer_norm_fwd(Binding b) {
  return buffer_rets<3>(buffer_args<3>(std::move(b)))
      .template Attr<double>("epsilon");
}

// jaxops_rms_norm_fwd: x, scale -> y, rstd.
template <class Binding>
auto bind_rms_norm_fwd(Binding b) {
  return buffer_rets<2>(buffer_args<2>(std::move(b)))
      .template Attr<double>("epsilon");
}

// jaxops_layer_norm_bwd: x, scale, mean, rstd, dy -> dx, dscale, dbias, workspace.
template <class Binding>
auto bind_layer_norm_bwd(Binding b) {
  return buffer_rets<4>(buffer_args<5>(std::move(b)));
}

// jaxops_rms_norm_bwd: x, scale, rstd, dy -> dx, dscale, workspace.
template <class Binding>
auto bind_rms_norm_bwd(Binding b) {
  return buffer_rets<3>(buffer_args<4>(std::move(b)));
}

}  // namespace jaxops::layer_norm
