#include "reduce/reduce_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cpu_columns.h"
#include "common/cpu_rows.h"
#include "common/cpu_sums.h"
#include "common/cpu_vec.h"

namespace jaxops::reduce {
namespace {

using cpu::acc_t;
using cpu::from_float;
using cpu::to_float;

constexpr int64_t kLeaf = 64;  // rows added sequentially before pairing (columns)

// Folds a sequence of values pairwise, as a balanced tree over the order they come in (a binary
// counter: two values of one level merge into the next), without recursion or a second buffer.
// merge(left, right) folds left into right: right = left . right. Serves the row blocks' states
// and the column logsumexp's partial-sum rows.
template <class S, class Merge>
class PairwiseFold {
 public:
  explicit PairwiseFold(Merge merge) : merge_(merge) {}
  void push(S s) {
    int level = 0;
    while (n_ > 0 && level_[n_ - 1] == level) {
      merge_(stack_[--n_], s);
      ++level;
    }
    stack_[n_] = std::move(s);
    level_[n_++] = level;
  }
  // The fold of everything pushed; `empty` when nothing was.
  S result(S empty) {
    if (n_ == 0) return empty;
    S s = std::move(stack_[n_ - 1]);
    for (int i = n_ - 2; i >= 0; --i) merge_(stack_[i], s);
    return s;
  }

 private:
  Merge merge_;
  S stack_[64];
  int level_[64];
  int n_ = 0;
};

template <class Op, class A = typename Op::State>
constexpr bool kExtremumOp = std::is_same_v<Op, ExtremumOp<A, true>> || std::is_same_v<Op, ExtremumOp<A, false>>;
template <class Op, class A = typename Op::State>
constexpr bool kSumOp = std::is_same_v<Op, SumOp<A, true>> || std::is_same_v<Op, SumOp<A, false>>;
template <class Op>
constexpr bool kArgOp = std::is_same_v<Op, ArgOp<float, true>> || std::is_same_v<Op, ArgOp<float, false>>;
// Column reductions of float data run through register tiles (cpu_columns.h).
template <class Op>
constexpr bool kFloatColumns = (std::is_same_v<typename Op::State, float> && (kSumOp<Op> || kExtremumOp<Op>)) ||
                               kArgOp<Op>;

// Sum, mean, max, min and logsumexp of one contiguous row, a kSumBlock-element block at a time
// (cpu_sums.h), the blocks folded pairwise. logsumexp takes two passes over a block (its max, then
// the sum of exp(x - max)) instead of the online form's exp per element.
template <int W, class Op, class T>
typename Op::State row_blocks(const T* x, int64_t n) {
  using A = acc_t<T>;
  A scratch[std::is_same_v<T, A> || !std::is_same_v<Op, LogSumExpOp<A>> ? 1 : cpu::kSumBlock];
  using S = typename Op::State;
  const auto merge = [](const S& left, S& right) { right = Op::merge(left, right); };
  PairwiseFold<S, decltype(merge)> fold(merge);
  for (int64_t b = 0; b < n; b += cpu::kSumBlock) {
    const int64_t m = std::min(cpu::kSumBlock, n - b);
    if constexpr (std::is_same_v<Op, LogSumExpOp<A>>) {
      // Two passes over the block: float / double rows in place, 16-bit ones widened once.
      const A* buf = cpu::acc_row(x + b, scratch, m);
      const A mx = cpu::lane_extremum<W, true>(buf, m);
      if (!std::isfinite(mx)) {  // NaN, +inf or all -inf: the answer itself (see LogSumExpOp)
        fold.push({mx, A(0)});
        continue;
      }
      fold.push({mx, cpu::block_exp_sum<W>(buf, mx, m)});
    } else if constexpr (kExtremumOp<Op>) {
      fold.push(cpu::lane_extremum<W, Op::kIsMax>(x + b, m));
    } else {
      fold.push(cpu::block_sum<W>(x + b, m));
    }
  }
  return fold.result(Op::identity());
}

// argmax (kMax) / argmin of one contiguous row: its NaN-propagating extremum (lane_extremum, a
// block at a time), then the first index holding it (first_index_of): jnp.argmax's answer (the
// first NaN, else the lowest index among ties, -0 and +0 equal) in two vectorized passes instead
// of a compare-and-branch an element (session 52's twin: 3 ns an element, 1.3x XLA's time).
// 16-bit rows are widened for the second pass only, or once when they are one block long.
template <int W, bool kMax, class T>
int32_t row_arg(const T* x, int64_t n) {
  using A = acc_t<T>;
  A scratch[std::is_same_v<T, A> ? 1 : cpu::kSumBlock];
  if constexpr (!std::is_same_v<T, A>) {
    if (n <= cpu::kSumBlock) {  // one block: widened once for both passes
      cpu::widen(x, scratch, n);
      return row_arg<W, kMax>(static_cast<const A*>(scratch), n);
    }
  }
  A m = kMax ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity();
  for (int64_t b = 0; b < n; b += cpu::kSumBlock) {
    const A bm = cpu::lane_extremum<W, kMax>(x + b, std::min(cpu::kSumBlock, n - b));
    if (cpu::beats<kMax>(bm, m)) m = bm;
  }
  for (int64_t b = 0; b < n; b += cpu::kSumBlock) {
    const int64_t len = std::min(cpu::kSumBlock, n - b);
    const A* buf = cpu::acc_row(x + b, scratch, len);
    const int64_t i = cpu::first_index_of<W>(buf, len, m);
    if (i < len) return static_cast<int32_t>(b + i);
  }
  return 0;  // empty rows (and, unreachably, no match)
}

// Rows [lo, hi) of a (reduced, inner) slab, widened a row at a time into `row` (inner elements).
// Leaves add rows in order into acc[inner], pairs of halves merge (acc holds identities).
template <class Op, class T>
void columns_pairwise(const T* x, int64_t lo, int64_t hi, int64_t inner, typename Op::State* acc, acc_t<T>* row) {
  if (hi - lo <= kLeaf) {
    for (int64_t r = lo; r < hi; ++r) {
      const acc_t<T>* rv = cpu::acc_row(x + r * inner, row, inner);  // float / double rows in place
      if constexpr (kExtremumOp<Op>) cpu::extremum_into<Op::kIsMax>(acc, rv, inner);
      else for (int64_t c = 0; c < inner; ++c) Op::add(acc[c], rv[c], r);
    }
    return;
  }
  const int64_t mid = lo + (hi - lo) / 2;
  columns_pairwise<Op>(x, lo, mid, inner, acc, row);
  std::vector<typename Op::State> right(inner, Op::identity());
  columns_pairwise<Op>(x, mid, hi, inner, right.data(), row);
  for (int64_t c = 0; c < inner; ++c) acc[c] = Op::merge(acc[c], right[c]);
}

// The columns of a (reduced, inner) slab for kFloatColumns ops: leaves of kLeaf rows in order
// (column_leaf), the leaves folded pairwise by PairwiseFold; no recursion, so all of it inlines
// into the AVX2 clone.
template <int W, class Op, class T>
void columns_fold(const T* x, int64_t reduced, int64_t inner, typename Op::State* out) {
  using S = std::vector<typename Op::State>;
  const auto merge = [inner](const S& left, S& right) {
    for (int64_t c = 0; c < inner; ++c) right[c] = Op::merge(left[c], right[c]);
  };
  PairwiseFold<S, decltype(merge)> fold(merge);
  std::vector<float> best(kArgOp<Op> ? inner : 0);
  std::vector<int32_t> idx(kArgOp<Op> ? inner : 0);
  for (int64_t r0 = 0; r0 < reduced; r0 += kLeaf) {
    S leaf(inner, Op::identity());
    const int64_t rows = std::min(kLeaf, reduced - r0);
    if constexpr (kArgOp<Op>) {  // values and indices apart, so the tiles hold them in vectors
      std::fill(best.begin(), best.end(), Op::identity().v);
      std::fill(idx.begin(), idx.end(), Op::identity().i);
      cpu::column_arg_leaf<W, Op::kIsMax>(x + r0 * inner, r0, rows, inner, best.data(), idx.data());
      for (int64_t c = 0; c < inner; ++c) leaf[c] = {best[c], idx[c]};
    } else if constexpr (kSumOp<Op>) {
      cpu::column_leaf<W, true, true>(x + r0 * inner, rows, inner, leaf.data());
    } else {
      cpu::column_leaf<W, false, Op::kIsMax>(x + r0 * inner, rows, inner, leaf.data());
    }
    fold.push(std::move(leaf));
  }
  const S total = fold.result(S(inner, Op::identity()));
  std::copy(total.begin(), total.end(), out);
}

// Column logsumexp: the columns' max (pairwise, as max_cols), then the sums of exp(x - max),
// leaves of kLeaf rows (float states: cpu::column_exp_sums, register tiles) folded by
// PairwiseFold (no recursion: all of it inlines into the AVX2 clone), then max + log(sum).
template <int W, class T>
void columns_logsumexp(const T* x, int64_t reduced, int64_t inner, acc_t<T>* out) {
  using A = acc_t<T>;
  std::vector<A> mx(inner, -std::numeric_limits<A>::infinity()), row(inner);
  if constexpr (std::is_same_v<A, float>) columns_fold<W, ExtremumOp<A, true>>(x, reduced, inner, mx.data());
  else columns_pairwise<ExtremumOp<A, true>>(x, 0, reduced, inner, mx.data(), row.data());
  const auto add = [inner](const std::vector<A>& left, std::vector<A>& right) {
    for (int64_t c = 0; c < inner; ++c) right[c] = left[c] + right[c];
  };
  PairwiseFold<std::vector<A>, decltype(add)> fold(add);
  for (int64_t r0 = 0; r0 < reduced; r0 += kLeaf) {
    std::vector<A> leaf(inner, A(0));
    const int64_t rows = std::min(reduced, r0 + kLeaf) - r0;
    if constexpr (std::is_same_v<A, float>) {
      cpu::column_exp_sums<W>(x + r0 * inner, rows, inner, mx.data(), leaf.data());
    } else {
      for (int64_t r = r0; r < r0 + rows; ++r) {
        cpu::widen(x + r * inner, row.data(), inner);
        for (int64_t c = 0; c < inner; ++c) row[c] -= mx[c];
        cpu::exp_shifted<W>(row.data(), A(0), row.data(), inner);
        for (int64_t c = 0; c < inner; ++c) leaf[c] += row[c];
      }
    }
    fold.push(std::move(leaf));
  }
  const std::vector<A> sum = fold.result(std::vector<A>(inner, A(0)));
  for (int64_t c = 0; c < inner; ++c) out[c] = std::isfinite(mx[c]) ? mx[c] + std::log(sum[c]) : mx[c];
}

template <class Op, class T>
void store(void* y, int64_t at, const typename Op::State& s, int64_t count) {
  if constexpr (Op::kIndex) static_cast<int32_t*>(y)[at] = Op::finish(s, count);
  else static_cast<T*>(y)[at] = from_float<T>(Op::finish(s, count));
}

template <int W, class Op, class T>
void run(const T* x, void* y, int64_t outer, int64_t reduced, int64_t inner) {
  using A = acc_t<T>;
  std::vector<typename Op::State> acc;
  std::vector<A> row, lse;
  for (int64_t o = 0; o < outer; ++o) {
    const T* xo = x + o * reduced * inner;
    if (inner == 1) {
      if constexpr (Op::kIndex) static_cast<int32_t*>(y)[o] = row_arg<W, Op::kIsMax>(xo, reduced);
      else store<Op, T>(y, o, row_blocks<W, Op>(xo, reduced), reduced);
      continue;
    }
    if constexpr (std::is_same_v<Op, LogSumExpOp<A>>) {
      lse.resize(inner);
      columns_logsumexp<W>(xo, reduced, inner, lse.data());
      for (int64_t c = 0; c < inner; ++c) static_cast<T*>(y)[o * inner + c] = from_float<T>(lse[c]);
      continue;
    }
    acc.assign(inner, Op::identity());
    row.resize(inner);
    if constexpr (kFloatColumns<Op>) columns_fold<W, Op>(xo, reduced, inner, acc.data());
    else columns_pairwise<Op>(xo, 0, reduced, inner, acc.data(), row.data());
    for (int64_t c = 0; c < inner; ++c) store<Op, T>(y, o * inner + c, acc[c], reduced);
  }
}

template <int W, class T>
void run_kind(OpKind kind, const T* x, void* y, int64_t outer, int64_t reduced, int64_t inner) {
  using A = acc_t<T>;
  switch (kind) {
    case OpKind::kSum: return run<W, SumOp<A, false>>(x, y, outer, reduced, inner);
    case OpKind::kMean: return run<W, SumOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kMax: return run<W, ExtremumOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kMin: return run<W, ExtremumOp<A, false>>(x, y, outer, reduced, inner);
    case OpKind::kLogSumExp: return run<W, LogSumExpOp<A>>(x, y, outer, reduced, inner);
    case OpKind::kArgMax: return run<W, ArgOp<A, true>>(x, y, outer, reduced, inner);
    case OpKind::kArgMin: return run<W, ArgOp<A, false>>(x, y, outer, reduced, inner);
  }
}

}  // namespace

bool reduce_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t outer, int64_t reduced,
                int64_t inner) {
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      run_kind<w.value>(kind, static_cast<const T*>(x), y, outer, reduced, inner);
    });
  });
}

}  // namespace jaxops::reduce
