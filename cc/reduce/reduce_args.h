// Argument checks shared by the CPU and CUDA reduction handlers: both validate the same way
// before touching memory.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_util.h"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce {

// Every reduction runs on an (outer, reduced, inner) view of its input: the reduced axes are
// one contiguous block of the row-major layout (the Python side transposes when they are not).
struct View {
  OpKind kind = OpKind::kSum;
  Dtype dtype = Dtype::kInvalid;
  int64_t outer = 0;
  int64_t reduced = 0;
  int64_t inner = 0;
  int64_t splits = 1;  // chunks of the reduced axis (CUDA grid split); the CPU ignores it
};

inline const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kSum: return "sum";
    case OpKind::kMean: return "mean";
    case OpKind::kMax: return "max";
    case OpKind::kMin: return "min";
    case OpKind::kLogSumExp: return "logsumexp";
    case OpKind::kArgMax: return "argmax";
    case OpKind::kArgMin: return "argmin";
  }
  return "reduce";
}

// x: [batch..., outer, reduced, inner]; y: [batch..., outer, inner] (x's dtype, int32 for the
// arg ops); ws: uint8 workspace for the per-chunk partial states when splits > 1.
inline ffi::Error check_reduce(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                               const ffi::AnyBuffer& ws, int64_t op, int64_t splits, View* v) {
  if (op < 0 || op > 6) return invalid_argument("reduce", "unknown op " + std::to_string(op));
  v->kind = static_cast<OpKind>(op);
  const char* name = op_name(v->kind);
  if (auto err = require_float(name, x, &v->dtype); err.failure()) return err;
  auto xd = x.dimensions(), yd = y.dimensions();
  const size_t r = xd.size();
  if (r < 2) return invalid_argument(name, "expected an (outer, reduced) or (outer, reduced, inner) view");
  for (size_t i = 0; i < r; ++i)
    if (xd[i] < 0) return invalid_argument(name, "negative dimension");
  // The reduced axis: the last of a rank-2 (outer, reduced) view of rows (jaxops/_reductions.py
  // passes rows so, because XLA:CPU copied a bfloat16 (outer, reduced, 1) operand into a new
  // layout first), else the second to last. y is x's shape without it.
  const size_t red = r == 2 ? 1 : r - 2;
  v->outer = dims_product(xd, 0, red);
  v->reduced = xd[red];
  v->inner = dims_product(xd, red + 1, r);
  bool shape_ok = yd.size() == r - 1;
  for (size_t i = 0; shape_ok && i + 1 < r; ++i) shape_ok = yd[i] == xd[i < red ? i : i + 1];
  if (!shape_ok) return invalid_argument(name, "output shape must be x's shape without the reduced axis");
  const bool arg = is_arg(v->kind);
  if (arg ? y.element_type() != ffi::DataType::S32 : y.element_type() != x.element_type())
    return invalid_argument(name, arg ? "output must be int32" : "output must have x's dtype");
  if (arg && v->reduced > INT32_MAX)
    return invalid_argument(name, "reduced extent " + std::to_string(v->reduced) + " does not fit int32 indices");
  if ((arg || v->kind == OpKind::kMax || v->kind == OpKind::kMin) && v->reduced == 0 &&
      v->outer * v->inner > 0)
    return invalid_argument(name, "zero-size reduction has no identity");
  if (splits < 1) return invalid_argument(name, "splits must be >= 1, got " + std::to_string(splits));
  v->splits = splits;
  if (ws.element_type() != ffi::DataType::U8) return invalid_argument(name, "workspace must be uint8");
  if (splits > 1) {
    const int64_t need = v->outer * v->inner * splits * state_bytes(v->kind, v->dtype == Dtype::kF64);
    if (static_cast<int64_t>(ws.size_bytes()) < need)
      return invalid_argument(name, "workspace of " + std::to_string(ws.size_bytes()) +
                                        " bytes is smaller than the " + std::to_string(need) + " needed");
  }
  return ffi::Error::Success();
}

// FFI signature of jaxops_reduce, written once so the CPU and CUDA handlers cannot disagree:
// operands, results and attributes in the order the Python side passes them. `b` is
// ffi::Ffi::Bind(), with the stream context already bound on CUDA.
template <class Binding>
auto bind_reduce(Binding b) {
  return buffer_rets<2>(buffer_args<1>(std::move(b)))
      .template Attr<int64_t>("op")
      .template Attr<int64_t>("splits");
}

}  // namespace jaxops::reduce
