// The reduction operators every kernel (CUDA and CPU twin) is built from. Each op is a
// monoid over a small State: identity(), add(state, element, index), merge(a, b) and
// finish(state, count). merge is commutative bit for bit (IEEE + and the NaN-aware max are),
// and the arg ops break ties by index, so any fixed combining tree gives one answer.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __CUDACC__
#define JAXOPS_HD __host__ __device__ __forceinline__
#else
#define JAXOPS_HD inline
#endif

namespace jaxops::reduce {

// Values of the `op` attribute of the jaxops_reduce FFI target (jaxops/_reductions.py: _OPS).
enum class OpKind : int { kSum = 0, kMean = 1, kMax = 2, kMin = 3, kLogSumExp = 4, kArgMax = 5, kArgMin = 6 };

inline bool is_arg(OpKind k) { return k == OpKind::kArgMax || k == OpKind::kArgMin; }

template <class A> JAXOPS_HD A inf_of() { return std::numeric_limits<A>::infinity(); }
template <class A> JAXOPS_HD A nan_of() { return std::numeric_limits<A>::quiet_NaN(); }
template <class A> JAXOPS_HD bool is_nan(A v) { return v != v; }

JAXOPS_HD float exp_acc(float v) { return expf(v); }
JAXOPS_HD double exp_acc(double v) { return exp(v); }
JAXOPS_HD float log_acc(float v) { return logf(v); }
JAXOPS_HD double log_acc(double v) { return log(v); }

// sum and mean: one running sum (the kernels supply the pairwise/tree structure).
template <class A, bool kMean>
struct SumOp {
  using State = A;
  static constexpr bool kIndex = false;
  static JAXOPS_HD State identity() { return A(0); }
  static JAXOPS_HD void add(State& s, A x, int64_t) { s += x; }
  static JAXOPS_HD State merge(const State& a, const State& b) { return a + b; }
  static JAXOPS_HD A finish(const State& s, int64_t count) {
    return kMean ? s / static_cast<A>(count) : s;  // empty mean: 0/0 = NaN like jnp
  }
};

// max / min propagating NaN like jnp.max (fmax would drop it).
template <class A, bool kMax>
struct ExtremumOp {
  using State = A;
  static constexpr bool kIndex = false;
  static constexpr bool kExtremum = true;
  static constexpr bool kIsMax = kMax;
  static JAXOPS_HD State identity() { return kMax ? -inf_of<A>() : inf_of<A>(); }
  static JAXOPS_HD State merge(const State& a, const State& b) {
    return (is_nan(a) || (kMax ? a > b : a < b)) ? a : b;
  }
  static JAXOPS_HD void add(State& s, A x, int64_t) { s = merge(x, s); }
  static JAXOPS_HD A finish(const State& s, int64_t) { return s; }
};

// logsumexp in one pass: a running (max, sum of exp(x - max)) pair, rescaled when the max
// grows. Only a finite final max needs a meaningful sum: NaN, +inf and -inf (all -inf or
// empty) are the answer themselves, which gives jax.nn.logsumexp's inf/NaN semantics.
template <class A>
struct LogSumExpState {
  A m;
  A s;
};

template <class A>
struct LogSumExpOp {
  using State = LogSumExpState<A>;
  static constexpr bool kIndex = false;
  static JAXOPS_HD State identity() { return {-inf_of<A>(), A(0)}; }
  // Branch-free (selects, one exp per element), so the compiler can overlap the exps of
  // independent elements; a branch per element serialised them on the GPU. Same values as
  // the case analysis: a new max rescales (exp(-inf) = 0 covers the first finite element);
  // -inf adds nothing (its exp argument may be -inf - -inf = NaN, hence the select); a NaN x
  // becomes the max and sticks (nothing compares greater); s is meaningless, and ignored by
  // merge/finish, whenever m is NaN or +-inf.
  static JAXOPS_HD void add(State& st, A x, int64_t) {
    const bool up = x > st.m;
    const A e = exp_acc(up ? st.m - x : x - st.m);
    const A term = x == -inf_of<A>() ? A(0) : e;
    st.s = up ? st.s * e + A(1) : st.s + term;
    st.m = (up || is_nan(x)) ? x : st.m;
  }
  // The larger max's sum needs no rescale (its exp(0) is 1 exactly), so a merge takes one exp,
  // not two: the GPU's block and warp merges are per-row overhead on short rows. Equal maxes add
  // b.s + a.s, which IEEE addition makes the same bits as a.s + b.s: merge stays commutative.
  static JAXOPS_HD State merge(const State& a, const State& b) {
    const bool a_wins = is_nan(a.m) || a.m > b.m;
    const A m = a_wins ? a.m : b.m;
    if (is_nan(m) || m == inf_of<A>() || m == -inf_of<A>()) return {m, A(0)};
    const State& lo = a_wins ? b : a;
    return {m, (a_wins ? a.s : b.s) + lo.s * exp_acc(lo.m - m)};
  }
  static JAXOPS_HD A finish(const State& st, int64_t) {
    if (is_nan(st.m) || st.m == inf_of<A>() || st.m == -inf_of<A>()) return st.m;
    return st.m + log_acc(st.s);
  }
};

// argmax / argmin: (value, index); NaN beats everything, ties go to the lower index.
template <class A>
struct ArgState {
  A v;
  int32_t i;
};

// The identity's index is -1, below every element's, so a state that never took an element
// wins its ties and finish() reads -1 as 0. It wins only when every element equals the identity
// value (-inf for argmax), whose first index is 0. That lets add() take an element only when it
// is strictly better, with no case for the first element.
template <class A, bool kMax>
struct ArgOp {
  using State = ArgState<A>;
  static constexpr bool kIndex = true;
  static constexpr bool kIsMax = kMax;
  static JAXOPS_HD State identity() { return {kMax ? -inf_of<A>() : inf_of<A>(), -1}; }
  // True when a should be chosen over b. One predicate expression, no early returns: short-circuit
  // returns compiled to ~4 branches a merge (H100, session 19 run 1: bf16 argmax full 50.2 -> 48.8
  // µs, 64x1048575 55.0 -> 53.0).
  static JAXOPS_HD bool better(const State& a, const State& b) {
    const bool an = is_nan(a.v), bn = is_nan(b.v), first = a.i < b.i;
    const bool wins = kMax ? a.v > b.v : a.v < b.v;
    return (an & (!bn | first)) | (!an & !bn & (wins | ((a.v == b.v) & first)));
  }
  static JAXOPS_HD State merge(const State& a, const State& b) { return better(a, b) ? a : b; }
  // idx must exceed every index s has seen (each slot scans in index order; add_unordered
  // otherwise): a tie then keeps s, so the test is one unordered compare and a NaN check, about
  // 4 instructions an element where better() takes about 10: the float32 loops were bound by
  // them (H100, session 19 run 2, µs: argmax 16384x4096 88.3 -> 86.7, 16384x4095 108.6 -> 87.7,
  // full 93.6 -> 89.8, XLA 86.2 / 88.4 / 88.4; bf16 argmax_cols 1048576x64 54.1 -> 52.1).
  static JAXOPS_HD void add(State& s, A x, int64_t idx) {
    if (!is_nan(s.v) && !(kMax ? x <= s.v : x >= s.v)) s = {x, static_cast<int32_t>(idx)};
  }
  static JAXOPS_HD int32_t finish(const State& s, int64_t) { return s.i < 0 ? 0 : s.i; }
};

// Op::add for an element whose index may be below ones s has seen (a row's head elements, added
// after its packs): the arg ops merge it as a state, the others do not look at indices.
template <class Op, class A>
JAXOPS_HD void add_unordered(typename Op::State& s, A x, int64_t idx) {
  if constexpr (Op::kIndex) s = Op::merge(s, {x, static_cast<int32_t>(idx)});
  else Op::add(s, x, idx);
}

// Bytes of one State, as the host computes workspace sizes (static_asserts in the .cu check it).
inline int64_t state_bytes(OpKind k, bool f64) {
  const int64_t acc = f64 ? 8 : 4;
  switch (k) {
    case OpKind::kLogSumExp: return 2 * acc;
    case OpKind::kArgMax:
    case OpKind::kArgMin: return f64 ? 16 : 8;
    default: return acc;
  }
}

}  // namespace jaxops::reduce
