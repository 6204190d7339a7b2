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
// The merges of the folds, named once: a slice's pieces (below) give the serial answer bit for
// bit only if they merge exactly as the serial folds do. merge(left, right): right = left . right.
template <class Op>
struct MergeStates {  // one state (a row's blocks)
  void operator()(const typename Op::State& left, typename Op::State& right) const { right = Op::merge(left, right); }
};
template <class Op>
struct MergeColumns {  // a state a column
  int64_t inner;
  void operator()(const std::vector<typename Op::State>& left, std::vector<typename Op::State>& right) const {
    for (int64_t c = 0; c < inner; ++c) right[c] = Op::merge(left[c], right[c]);
  }
};
template <class A>
struct AddColumns {  // the column logsumexp's sums of exp
  int64_t inner;
  void operator()(const std::vector<A>& left, std::vector<A>& right) const {
    for (int64_t c = 0; c < inner; ++c) right[c] = left[c] + right[c];
  }
};

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
  PairwiseFold<S, MergeStates<Op>> fold(MergeStates<Op>{});
  for (int64_t b = 0; b < n; b += cpu::kSumBlock) {
    const int64_t m = std::min(cpu::kSumBlock, n - b);
    if constexpr (std::is_same_v<Op, LogSumExpOp<A>>) {
      // Two passes over the block (its max, then the exps): in place or widened once
      // (cpu::two_passes_in_place).
      const auto block = [&](const auto* buf) {
        const A mx = cpu::lane_extremum<W, true>(buf, m);
        // NaN, +inf or all -inf: the answer itself (see LogSumExpOp)
        fold.push({mx, std::isfinite(mx) ? cpu::block_exp_sum<W>(buf, mx, m) : A(0)});
      };
      if (cpu::two_passes_in_place<W, T>(m)) block(x + b);
      else block(cpu::acc_row(x + b, scratch, m));
    } else if constexpr (kExtremumOp<Op>) {
      fold.push(cpu::lane_extremum<W, Op::kIsMax>(x + b, m));
    } else {
      fold.push(cpu::block_sum<W>(x + b, m));
    }
  }
  return fold.result(Op::identity());
}

// A row's NaN-propagating extremum and the first kSumBlock-element block that holds it.
template <class A>
struct BlockExtremum {
  A m;
  int64_t block;  // its first element's index in the row
};

// Whether `next`, from later in the row, replaces `run` in the argmax (kMax) / argmin: it is
// better, or the first NaN (ties and later NaNs keep the earlier block, which holds the first).
template <bool kMax, class A>
bool replaces(const BlockExtremum<A>& next, const BlockExtremum<A>& run) {
  return run.m == run.m && cpu::beats<kMax>(next.m, run.m);
}

// The argmax / argmin steps (row_extremum, find_in_block) read 16-bit blocks in place, but for the
// baseline build (W = 4, SSE2), which widens them first: there GCC widened them a lane at a time
// inside the extremum's loop (session 75: bf16 argmax of 5000-long rows 1.5 -> 2.7 µs in place).
template <int W, class T>
constexpr bool kArgWidensFirst = W == 4 && !std::is_same_v<T, acc_t<T>>;

// BlockExtremum of a contiguous row (starting at `base` in its row), one pass a block at a time.
template <int W, bool kMax, class T>
BlockExtremum<acc_t<T>> row_extremum(const T* x, int64_t n, int64_t base) {
  using A = acc_t<T>;
  BlockExtremum<A> run{kMax ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity(), base};
  constexpr bool kWidenFirst = kArgWidensFirst<W, T>;
  A scratch[kWidenFirst ? cpu::kSumBlock : 1];
  for (int64_t b = 0; b < n; b += cpu::kSumBlock) {
    const int64_t m = std::min(cpu::kSumBlock, n - b);
    const A e = kWidenFirst ? cpu::lane_extremum<W, kMax>(cpu::acc_row(x + b, scratch, m), m)
                            : cpu::lane_extremum<W, kMax>(x + b, m);
    const BlockExtremum<A> next{e, base + b};
    if (replaces<kMax>(next, run)) run = next;
  }
  return run;
}

// The first index of row x (n elements) holding e.m: in block e.block (first_index_of); 0 for an
// empty row.
template <int W, class T>
int32_t find_in_block(const T* x, int64_t n, const BlockExtremum<acc_t<T>>& e) {
  using A = acc_t<T>;
  const int64_t len = std::min(cpu::kSumBlock, n - e.block);
  if (len <= 0) return 0;
  constexpr bool kWidenFirst = kArgWidensFirst<W, T>;
  A scratch[kWidenFirst ? cpu::kSumBlock : 1];
  const int64_t i = kWidenFirst ? cpu::first_index_of<W>(cpu::acc_row(x + e.block, scratch, len), len, e.m)
                                : cpu::first_index_of<W>(x + e.block, len, e.m);
  return static_cast<int32_t>(i < len ? e.block + i : 0);  // (no match: unreachable)
}

// argmax (kMax) / argmin of one contiguous row: its NaN-propagating extremum and the block where
// it first occurs (row_extremum), then the first index in that block holding it: jnp.argmax's
// answer (the first NaN, else the lowest index among ties, -0 and +0 equal) in one vectorized pass
// and one block, instead of a compare-and-branch an element (session 52's twin: 3 ns an element)
// or a second pass (session 53's to session 59's). 16-bit rows are read in place (the baseline
// build widens them a block at a time).
template <int W, bool kMax, class T>
int32_t row_arg(const T* x, int64_t n) {
  return find_in_block<W>(x, n, row_extremum<W, kMax>(x, n, 0));
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
// into the AVX2 clone. The arg ops count rows from `base` (the slab's first row in its slice).
template <int W, class Op, class T>
void columns_fold(const T* x, int64_t reduced, int64_t inner, typename Op::State* out, int64_t base = 0) {
  using S = std::vector<typename Op::State>;
  PairwiseFold<S, MergeColumns<Op>> fold(MergeColumns<Op>{inner});
  std::vector<float> best(kArgOp<Op> ? inner : 0);
  std::vector<int32_t> idx(kArgOp<Op> ? inner : 0);
  for (int64_t r0 = 0; r0 < reduced; r0 += kLeaf) {
    S leaf(inner, Op::identity());
    const int64_t rows = std::min(kLeaf, reduced - r0);
    if constexpr (kArgOp<Op>) {  // values and indices apart, so the tiles hold them in vectors
      std::fill(best.begin(), best.end(), Op::identity().v);
      std::fill(idx.begin(), idx.end(), Op::identity().i);
      cpu::column_arg_leaf<W, Op::kIsMax>(x + r0 * inner, base + r0, rows, inner, best.data(), idx.data());
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

// out[c] = the sum over the slab's rows of exp(x - mx[c]): leaves of kLeaf rows (float states:
// cpu::column_exp_sums, register tiles) folded by PairwiseFold (no recursion: all of it inlines
// into the AVX2 clone).
template <int W, class T>
void columns_exp_fold(const T* x, int64_t reduced, int64_t inner, const acc_t<T>* mx, acc_t<T>* out) {
  using A = acc_t<T>;
  std::vector<A> row(std::is_same_v<A, float> ? 0 : inner);
  PairwiseFold<std::vector<A>, AddColumns<A>> fold(AddColumns<A>{inner});
  for (int64_t r0 = 0; r0 < reduced; r0 += kLeaf) {
    std::vector<A> leaf(inner, A(0));
    const int64_t rows = std::min(reduced, r0 + kLeaf) - r0;
    if constexpr (std::is_same_v<A, float>) {
      cpu::column_exp_sums<W>(x + r0 * inner, rows, inner, mx, leaf.data());
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
  std::copy(sum.begin(), sum.end(), out);
}

// logsumexp of columns from their max and their sums of exp(x - max).
template <class A>
void finish_logsumexp(const A* mx, const A* sum, int64_t inner, A* out) {
  for (int64_t c = 0; c < inner; ++c) out[c] = std::isfinite(mx[c]) ? mx[c] + std::log(sum[c]) : mx[c];
}

// Column logsumexp: the columns' max (pairwise, as max_cols), then the sums of exp(x - max)
// (columns_exp_fold), then max + log(sum).
template <int W, class T>
void columns_logsumexp(const T* x, int64_t reduced, int64_t inner, acc_t<T>* out) {
  using A = acc_t<T>;
  std::vector<A> mx(inner, -std::numeric_limits<A>::infinity()), row(inner), sum(inner);
  if constexpr (std::is_same_v<A, float>) columns_fold<W, ExtremumOp<A, true>>(x, reduced, inner, mx.data());
  else columns_pairwise<ExtremumOp<A, true>>(x, 0, reduced, inner, mx.data(), row.data());
  columns_exp_fold<W>(x, reduced, inner, mx.data(), sum.data());
  finish_logsumexp(mx.data(), sum.data(), inner, out);
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

// ---- One slice over many threads ----
// The slice's units (kSumBlock-element blocks of a row; kLeaf-row leaves of columns) go to pieces
// of a power of two of them, at least reduce_grain elements. Each piece runs the serial code on
// its part of the slice, then the pieces' states are folded in order. A piece folds an aligned
// power-of-two run of units, which is a subtree of the serial fold's tree, and PairwiseFold merges
// right to left, so the answer is the serial one bit for bit, whatever the piece size or the
// thread count.
constexpr int64_t kMaxPieces = 64;

struct Pieces {
  int64_t rows = 0;   // slice rows a piece (its last one shorter)
  int64_t count = 1;  // pieces; 1: the serial code
};

Pieces slice_pieces(int64_t reduced, int64_t inner, int64_t grain) {
  const int64_t unit = inner == 1 ? cpu::kSumBlock : kLeaf;
  const int64_t units = (reduced + unit - 1) / unit;
  int64_t per = 1;  // units a piece
  while (per * unit * inner < grain || (units + per - 1) / per > kMaxPieces) per *= 2;
  return {per * unit, (units + per - 1) / per};
}

// piece(p, first row, rows) for every piece, on `ranges`. A std::function's body is compiled for
// the baseline ISA, so each range goes back into this W's clone (run_at).
template <int W, class Fn>
void for_pieces(const cpu::ForRanges& ranges, const Pieces& ps, int64_t reduced, int64_t inner, const Fn& piece) {
  ranges(ps.count, ps.rows * inner, [&](int64_t p0, int64_t p1) {
    cpu::run_at<W>([&](auto) {
      for (int64_t p = p0; p < p1; ++p) piece(p, p * ps.rows, std::min(ps.rows, reduced - p * ps.rows));
    });
  });
}

// The pieces' states folded in order (see above).
template <class S, class Merge>
S fold_pieces(std::vector<S>& states, Merge merge, S empty) {
  PairwiseFold<S, Merge> fold(merge);
  for (S& s : states) fold.push(std::move(s));
  return fold.result(std::move(empty));
}

// The columns' states (columns_fold) of a slice, in pieces.
template <int W, class Op, class T>
std::vector<typename Op::State> columns_in_pieces(const T* x, int64_t reduced, int64_t inner, const Pieces& ps,
                                                  const cpu::ForRanges& ranges) {
  using S = std::vector<typename Op::State>;
  std::vector<S> states(ps.count, S(inner));
  for_pieces<W>(ranges, ps, reduced, inner, [&](int64_t p, int64_t r0, int64_t rows) {
    columns_fold<W, Op>(x + r0 * inner, rows, inner, states[p].data(), r0);
  });
  return fold_pieces(states, MergeColumns<Op>{inner}, S(inner, Op::identity()));
}

template <int W, class Op, class T>
void run_slice(const T* x, void* y, int64_t reduced, int64_t inner, const Pieces& ps, const cpu::ForRanges& ranges) {
  using A = acc_t<T>;
  using S = typename Op::State;
  if (inner == 1) {
    if constexpr (Op::kIndex) {  // each piece's extremum and block, the first best of them
      std::vector<BlockExtremum<A>> ext(ps.count);
      for_pieces<W>(ranges, ps, reduced, 1, [&](int64_t p, int64_t r0, int64_t n) {
        ext[p] = row_extremum<W, Op::kIsMax>(x + r0, n, r0);
      });
      BlockExtremum<A> run = ext[0];
      for (const BlockExtremum<A>& e : ext) run = replaces<Op::kIsMax>(e, run) ? e : run;
      static_cast<int32_t*>(y)[0] = find_in_block<W>(x, reduced, run);
    } else {
      std::vector<S> states(ps.count);
      for_pieces<W>(ranges, ps, reduced, 1, [&](int64_t p, int64_t r0, int64_t n) {
        states[p] = row_blocks<W, Op>(x + r0, n);
      });
      store<Op, T>(y, 0, fold_pieces(states, MergeStates<Op>{}, Op::identity()), reduced);
    }
  } else if constexpr (std::is_same_v<Op, LogSumExpOp<A>> && std::is_same_v<A, float>) {
    const std::vector<A> mx = columns_in_pieces<W, ExtremumOp<A, true>>(x, reduced, inner, ps, ranges);
    std::vector<std::vector<A>> sums(ps.count, std::vector<A>(inner));
    for_pieces<W>(ranges, ps, reduced, inner, [&](int64_t p, int64_t r0, int64_t rows) {
      columns_exp_fold<W>(x + r0 * inner, rows, inner, mx.data(), sums[p].data());
    });
    const std::vector<A> sum = fold_pieces(sums, AddColumns<A>{inner}, std::vector<A>(inner, A(0)));
    std::vector<A> lse(inner);
    finish_logsumexp(mx.data(), sum.data(), inner, lse.data());
    for (int64_t c = 0; c < inner; ++c) static_cast<T*>(y)[c] = from_float<T>(lse[c]);
  } else if constexpr (kFloatColumns<Op>) {
    const std::vector<S> acc = columns_in_pieces<W, Op>(x, reduced, inner, ps, ranges);
    for (int64_t c = 0; c < inner; ++c) store<Op, T>(y, c, acc[c], reduced);
  } else {  // float64 columns (pairwise halves, not PairwiseFold): one thread
    run<W, Op>(x, y, 1, reduced, inner);
  }
}

template <int W, class T>
void run_slice_kind(OpKind kind, const T* x, void* y, int64_t reduced, int64_t inner, const Pieces& ps,
                    const cpu::ForRanges& ranges) {
  using A = acc_t<T>;
  switch (kind) {
    case OpKind::kSum: return run_slice<W, SumOp<A, false>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kMean: return run_slice<W, SumOp<A, true>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kMax: return run_slice<W, ExtremumOp<A, true>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kMin: return run_slice<W, ExtremumOp<A, false>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kLogSumExp: return run_slice<W, LogSumExpOp<A>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kArgMax: return run_slice<W, ArgOp<A, true>>(x, y, reduced, inner, ps, ranges);
    case OpKind::kArgMin: return run_slice<W, ArgOp<A, false>>(x, y, reduced, inner, ps, ranges);
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

bool reduce_slice_cpu(OpKind kind, Dtype dtype, const void* x, void* y, int64_t reduced, int64_t inner,
                      const cpu::ForRanges& ranges) {
  const Pieces ps = slice_pieces(reduced, inner, reduce_grain(kind));
  if (ps.count <= 1) return reduce_cpu(kind, dtype, x, y, 1, reduced, inner);
  return cpu::run_isa([&](auto w) {
    return cpu::dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      run_slice_kind<w.value>(kind, static_cast<const T*>(x), y, reduced, inner, ps, ranges);
    });
  });
}

}  // namespace jaxops::reduce
