#include "reduce/reduce_cpu.h"

#include <vector>

#include "common/cpu_float.h"

namespace jaxops::reduce {
namespace {

using cpu::acc_t;
using cpu::from_float;
using cpu::to_float;

constexpr int64_t kLeaf = 64;  // elements (rows) summed sequentially before pairing

// Pairwise over x[lo, hi) of one contiguous row.
template <class Op, class T>
typename Op::State row_pairwise(const T* x, int64_t lo, int64_t hi) {
  using A = acc_t<T>;
  if (hi - lo <= kLeaf) {
    auto s = Op::identity();
    for (int64_t r = lo; r < hi; ++r) Op::add(s, static_cast<A>(to_float(x[r])), r);
    return s;
  }
  const int64_t mid = lo + (hi - lo) / 2;
  return Op::merge(row_pairwise<Op>(x, lo, mid), row_pairwise<Op>(x, mid, hi));
}

// Pairwise over rows [lo, hi) of a (reduced, inner) slab into acc[inner] (acc holds identities).
template <class Op, class T>
void columns_pairwise(const T* x, int64_t lo, int64_t hi, int64_t inner, typename Op::State* acc) {
  using A = acc_t<T>;
  if (hi - lo <= kLeaf) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t c = 0; c < inner; ++c) Op::add(acc[c], static_cast<A>(to_float(x[r * inner + c])), r);
    return;
  }
  const int64_t mid = lo + (hi - lo) / 2;
  columns_pairwise<Op>(x, lo, mid, inner, acc);
  std::vector<typename Op::State> right(inner, Op::identity());
  columns_pairwise<Op>(x, mid, hi, inner, right.data());
  for (int64_t c = 0; c < inner; ++c) acc[c] = Op::merge(acc[c], right[c]);
}

template <class Op, class T>
void store(void* y, int64_t at, const typename Op::State& s, int64_t count) {
  if constexpr (Op::kIndex) static_cast<int32_t*>(y)[at] = Op::finish(s, count);
  else static_cast<T*>(y)[at] = from_float<T>(Op::finish(s, count));
}

template <class Op, class T>
void run(const T* x, void* y, int64_t outer, int64_t reduced, int64_t inner) {
  std::vector<typename Op::State> acc;
  for (int64_t o = 0; o < outer; ++o) {
    const T* xo = x + o * reduced * inner;
    if (inner == 1) {
      store<Op, T>(y, o, row_pairwise<Op>(xo, 0, reduced), reduced);
      continue;
    }
    acc.assign(inner, Op::identity());
    columns_pairwise<Op>(xo, 0, reduced, inner, acc.data());
    for (int64_t c = 0; c < inner; ++c) store<Op, T>(y, o * inner + c, acc[c], reduced);
  }
}

template <class T>
void run_kind(OpKind kind, const T* x, void* y, int64_t outer, int64_t reduced, int64_t inner) {
  using A = acc_t<T>;
  switch (kind) {
    case OpKind::kSum: return run<SumOp<A, false>>(x, y, outer, reduced, inner);
    case OpKind::kMean: return run<SumOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kMax: return run<ExtremumOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kMin: return run<ExtremumOp<A, false>>(x, y, outer, reduced, inner);
    case OpKind::kLogSumExp: return run<LogSumExpOp<A>>(x, y, outer, reduced, inner);
    case OpKind::kArgMax: return run<ArgOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kArgMin: return run<ArgOp<A, false>>(x, y, outer, reduced, inner);
  }
}

}  // namespace

bool reduce_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t outer, int64_t reduced,
                int64_t inner) {
  return cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    run_kind(kind, static_cast<const T*>(x), y, outer, reduced, inner);
  });
}

}  // namespace jaxops::reduce
