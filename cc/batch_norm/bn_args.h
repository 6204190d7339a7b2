// Argument checks shared by the CPU and CUDA batch_norm handlers: both validate the same way
// before touching memory.
//
// Layout: x is (G..., R, C) with C channels (the last axis; Python moves the channel axis last),
// R rows reduced per channel and G independent groups (vmap batch dimensions). Per-channel arrays
// are (G..., C) of the statistics dtype (float64 for float64 x, else float32). The relu mask
// holds ceil(R*C/32) uint32 words per group, bit j of word i = element 32i+j of the group.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "batch_norm/bn_view.h"
#include "common/ffi_util.h"

namespace jaxops::batch_norm {

inline ffi::Error check_x(const char* op, const ffi::AnyBuffer& x, View* v) {
  if (auto err = require_float(op, x, &v->dtype); err.failure()) return err;
  auto d = x.dimensions();
  if (d.size() < 2) return invalid_argument(op, "x must be (..., rows, channels)");
  v->channels = d[d.size() - 1];
  v->rows = d[d.size() - 2];
  v->groups = dims_product(d, 0, d.size() - 2);
  v->f64 = v->dtype == Dtype::kF64;
  return ffi::Error::Success();
}

inline ffi::Error check_same(const char* op, const char* name, const ffi::AnyBuffer& x,
                             const ffi::AnyBuffer& b) {
  if (b.element_type() != x.element_type() || !same_dims(x, b))
    return invalid_argument(op, std::string(name) + " must match x's shape and dtype");
  return ffi::Error::Success();
}

// (G..., extra..., C) in the statistics dtype: `extra` trailing dims before C (workspaces).
inline ffi::Error check_channels(const char* op, const char* name, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& p, const View& v, int extra = 0,
                                 int64_t* extra_dim = nullptr) {
  const auto want = v.f64 ? ffi::DataType::F64 : ffi::DataType::F32;
  if (p.element_type() != want)
    return invalid_argument(op, std::string(name) + " must be " + (v.f64 ? "float64" : "float32"));
  auto dx = x.dimensions(), dp = p.dimensions();
  bool ok = dp.size() == dx.size() - 1 + extra && dp[dp.size() - 1] == v.channels;
  for (size_t i = 0; ok && i + 2 < dx.size(); ++i) ok = dp[i] == dx[i];
  if (!ok) return invalid_argument(op, std::string(name) + " must have shape (..., channels)");
  if (extra_dim) *extra_dim = dims_product(dp, dx.size() - 2, dp.size() - 1);
  return ffi::Error::Success();
}

inline ffi::Error check_mask(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& mask,
                             bool used, View* v) {
  if (mask.element_type() != ffi::DataType::U32) return invalid_argument(op, "mask must be uint32");
  if (!used) {
    v->mask_words = 0;
    return ffi::Error::Success();
  }
  const int64_t words = (v->elements_per_group() + 31) / 32;
  auto dx = x.dimensions(), dm = mask.dimensions();
  bool ok = dm.size() == dx.size() - 1 && dm[dm.size() - 1] == words;
  for (size_t i = 0; ok && i + 2 < dx.size(); ++i) ok = dm[i] == dx[i];
  if (!ok) return invalid_argument(op, "mask must have ceil(rows*channels/32) words per group");
  v->mask_words = words;
  return ffi::Error::Success();
}

// Number of row blocks a workspace of shape (G..., cap, k, C) leaves room for.
inline ffi::Error check_workspace(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& ws,
                                  const View& v, int64_t k, int64_t* cap) {
  int64_t extra = 0;
  if (auto err = check_channels(op, "workspace", x, ws, v, 2, &extra); err.failure()) return err;
  auto d = ws.dimensions();
  if (d[d.size() - 2] != k || d[d.size() - 3] < 1) return invalid_argument(op, "workspace has the wrong shape");
  *cap = d[d.size() - 3];
  return ffi::Error::Success();
}

inline ffi::Error check_eps(const char* op, double eps) {
  if (!(eps >= 0)) return invalid_argument(op, "epsilon must be >= 0, got " + std::to_string(eps));
  return ffi::Error::Success();
}

// ---- one check per FFI target, used verbatim by the CPU and CUDA handlers ----

inline ffi::Error check_stats(const ffi::AnyBuffer& x, const ffi::AnyBuffer& mean,
                              const ffi::AnyBuffer& var, const ffi::AnyBuffer& ws, View* v,
                              int64_t* cap) {
  const char* op = "batch_norm";
  if (auto err = check_x(op, x, v); err.failure()) return err;
  if (auto err = check_channels(op, "mean", x, mean, *v); err.failure()) return err;
  if (auto err = check_channels(op, "var", x, var, *v); err.failure()) return err;
  return check_workspace(op, x, ws, *v, 3, cap);
}

// Coefficient workspace: (G..., 4, C) of the statistics dtype (one Coef record per channel).
inline ffi::Error check_coef(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& ws,
                             const View& v) {
  int64_t extra = 0;
  if (auto err = check_channels(op, "coefficient workspace", x, ws, v, 1, &extra); err.failure()) return err;
  if (extra != 4) return invalid_argument(op, "coefficient workspace must be (..., 4, channels)");
  return ffi::Error::Success();
}

inline ffi::Error check_apply(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                              const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mean,
                              const ffi::AnyBuffer& var, const ffi::AnyBuffer& residual,
                              const ffi::AnyBuffer& y, const ffi::AnyBuffer& mask,
                              const ffi::AnyBuffer& coef, double eps, bool relu, bool with_mask,
                              bool has_residual, View* v) {
  const char* op = "batch_norm";
  if (auto err = check_x(op, x, v); err.failure()) return err;
  if (auto err = check_eps(op, eps); err.failure()) return err;
  if (auto err = check_channels(op, "scale", x, scale, *v); err.failure()) return err;
  if (auto err = check_channels(op, "bias", x, bias, *v); err.failure()) return err;
  if (auto err = check_channels(op, "mean", x, mean, *v); err.failure()) return err;
  if (auto err = check_channels(op, "var", x, var, *v); err.failure()) return err;
  if (has_residual)
    if (auto err = check_same(op, "residual", x, residual); err.failure()) return err;
  if (auto err = check_same(op, "output", x, y); err.failure()) return err;
  if (auto err = check_coef(op, x, coef, *v); err.failure()) return err;
  return check_mask(op, x, mask, relu && with_mask, v);
}

// The fused training forward: check_apply's operands with mean/var as results, plus the
// statistics workspace.
inline ffi::Error check_forward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                const ffi::AnyBuffer& bias, const ffi::AnyBuffer& residual,
                                const ffi::AnyBuffer& y, const ffi::AnyBuffer& mask, const ffi::AnyBuffer& mean,
                                const ffi::AnyBuffer& var, const ffi::AnyBuffer& ws, const ffi::AnyBuffer& coef,
                                double eps, bool relu, bool with_mask, bool has_residual, View* v,
                                int64_t* cap) {
  if (auto err = check_apply(x, scale, bias, mean, var, residual, y, mask, coef, eps, relu, with_mask,
                             has_residual, v);
      err.failure())
    return err;
  return check_workspace("batch_norm", x, ws, *v, 3, cap);
}

inline ffi::Error check_backward_reduce(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& mask, const ffi::AnyBuffer& mean,
                                        const ffi::AnyBuffer& var, const ffi::AnyBuffer& sum_dy,
                                        const ffi::AnyBuffer& sum_dyxhat, const ffi::AnyBuffer& ws,
                                        double eps, bool relu, View* v, int64_t* cap) {
  const char* op = "batch_norm_bwd";
  if (auto err = check_x(op, x, v); err.failure()) return err;
  if (auto err = check_eps(op, eps); err.failure()) return err;
  if (auto err = check_same(op, "dy", x, dy); err.failure()) return err;
  if (auto err = check_channels(op, "mean", x, mean, *v); err.failure()) return err;
  if (auto err = check_channels(op, "var", x, var, *v); err.failure()) return err;
  if (auto err = check_channels(op, "sum_dy", x, sum_dy, *v); err.failure()) return err;
  if (auto err = check_channels(op, "sum_dyxhat", x, sum_dyxhat, *v); err.failure()) return err;
  if (auto err = check_workspace(op, x, ws, *v, 2, cap); err.failure()) return err;
  return check_mask(op, x, mask, relu, v);
}

inline ffi::Error check_backward_dx(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& mask, const ffi::AnyBuffer* per_channel[7],
                                    const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dres,
                                    const ffi::AnyBuffer& coef, double eps, bool relu,
                                    bool has_residual, int64_t count, View* v) {
  const char* op = "batch_norm_bwd";
  static const char* names[7] = {"scale", "mean", "var", "sum_dy", "sum_dyxhat", "dmean", "dvar"};
  if (auto err = check_x(op, x, v); err.failure()) return err;
  if (auto err = check_eps(op, eps); err.failure()) return err;
  if (count < 1) return invalid_argument(op, "count must be >= 1");
  if (auto err = check_same(op, "dy", x, dy); err.failure()) return err;
  for (int i = 0; i < 7; ++i)
    if (auto err = check_channels(op, names[i], x, *per_channel[i], *v); err.failure()) return err;
  if (auto err = check_same(op, "dx", x, dx); err.failure()) return err;
  if (has_residual)
    if (auto err = check_same(op, "dresidual", x, dres); err.failure()) return err;
  if (auto err = check_coef(op, x, coef, *v); err.failure()) return err;
  return check_mask(op, x, mask, relu, v);
}

// The training backward in one call: check_backward_reduce's operands with the sums as results,
// and check_backward_dx's (scale, dmean, dvar, dx, dres, coef); the count is the rows.
inline ffi::Error check_backward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::AnyBuffer& mask,
                                 const ffi::AnyBuffer& scale, const ffi::AnyBuffer& mean, const ffi::AnyBuffer& var,
                                 const ffi::AnyBuffer& dmean, const ffi::AnyBuffer& dvar, const ffi::AnyBuffer& dx,
                                 const ffi::AnyBuffer& dres, const ffi::AnyBuffer& sum_dy,
                                 const ffi::AnyBuffer& sum_dyxhat, const ffi::AnyBuffer& ws,
                                 const ffi::AnyBuffer& coef, double eps, bool relu, bool has_residual, View* v,
                                 int64_t* cap) {
  if (auto err = check_backward_reduce(dy, x, mask, mean, var, sum_dy, sum_dyxhat, ws, eps, relu, v, cap);
      err.failure())
    return err;
  const ffi::AnyBuffer* pc[7] = {&scale, &mean, &var, &sum_dy, &sum_dyxhat, &dmean, &dvar};
  View w;
  return check_backward_dx(dy, x, mask, pc, dx, dres, coef, eps, relu, has_residual, 1, &w);
}

// ---- one FFI signature per target, used verbatim by the CPU and CUDA handlers ----
// Operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.

// jaxops_bn_stats: x -> mean, var, ws.
template <class Binding>
auto bind_stats(Binding b) {
  return buffer_rets<3>(buffer_args<1>(std::move(b)));
}

// jaxops_bn_apply: x, scale, bias, mean, var, residual -> y, mask, coef.
template <class Binding>
auto bind_apply(Binding b) {
  return buffer_rets<3>(buffer_args<6>(std::move(b)))
      .template Attr<double>("epsilon")
      .template Attr<int64_t>("relu")
      .template Attr<int64_t>("with_mask")
      .template Attr<int64_t>("has_residual");
}

// jaxops_bn_forward: x, scale, bias, residual -> y, mask, mean, var, ws, coef.
template <class Binding>
auto bind_forward(Binding b) {
  return buffer_rets<6>(buffer_args<4>(std::move(b)))
      .template Attr<double>("epsilon")
      .template Attr<int64_t>("relu")
      .template Attr<int64_t>("with_mask")
      .template Attr<int64_t>("has_residual");
}

// jaxops_bn_bwd_reduce: dy, x, mask, mean, var -> sum_dy, sum_dyxhat, ws.
template <class Binding>
auto bind_backward_reduce(Binding b) {
  return buffer_rets<3>(buffer_args<5>(std::move(b)))
      .template Attr<double>("epsilon")
      .template Attr<int64_t>("relu");
}

// jaxops_bn_bwd_dx: dy, x, mask, scale, mean, var, sum_dy, sum_dyxhat, dmean, dvar -> dx, dres, coef.
template <class Binding>
auto bind_backward_dx(Binding b) {
  return buffer_rets<3>(buffer_args<10>(std::move(b)))
      .template Attr<double>("epsilon")
      .template Attr<int64_t>("relu")
      .template Attr<int64_t>("has_residual")
      .template Attr<int64_t>("train")
      .template Attr<int64_t>("count");
}

// jaxops_bn_backward: dy, x, mask, scale, mean, var, dmean, dvar -> dx, dres, sum_dy, sum_dyxhat, ws, coef.
template <class Binding>
auto bind_backward(Binding b) {
  return buffer_rets<6>(buffer_args<8>(std::move(b)))
      .template Attr<double>("epsilon")
      .template Attr<int64_t>("relu")
      .template Attr<int64_t>("has_residual");
}

}  // namespace jaxops::batch_norm
