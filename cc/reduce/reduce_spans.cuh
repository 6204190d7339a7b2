// What one thread (or lane) of a row reduction folds: its packs of a row span, with 16-byte or
// element loads (load_pack_v), independent slot states (slots_for, fold_slots), the packed 16-bit
// loops of reduce_fast16.cuh, and the head and tail of rows that are not whole packs.
#pragma once
#include <cstdint>

#include "common/cuda_util.cuh"
#include "reduce/reduce_fast16.cuh"
#include "reduce/reduce_plan.cuh"

namespace jaxops::reduce::kernels {

using cuda::acc_t;
using cuda::load_pack;
using cuda::Pack;
using cuda::to_acc;

// P elements at p. V: one vector load (p aligned to the pack); otherwise P element loads into
// the same pack, for a base pointer that is not 16-byte aligned. Only the load instruction
// differs: the tile, the slots and the order of every addition are the same, so a result
// never depends on the operand's address (perf6 determinism rule).
template <class T, int P, bool V>
__device__ __forceinline__ Pack<T, P> load_pack_v(const T* p) {
  if constexpr (V || P == 1) {
    return load_pack<T, P>(p);
  } else {
    Pack<T, P> pk;
#pragma unroll
    for (int j = 0; j < P; ++j) pk.v[j] = p[j];
    return pk;
  }
}

// Independent accumulator states per thread (element j of a pack goes to slot j % slots).
// Four break the per-element dependency chain (the arg ops' compare/select chain, the
// logsumexp expf chain) without spending 2-byte types' 8 x 2 registers on arg states.
template <int P>
constexpr int slots_for() {
  return P < 4 ? P : 4;
}

// Folds S slot states into one by a fixed tree (slot j with j + w, w = S/2 .. 1).
template <class Op, int S>
__device__ __forceinline__ typename Op::State fold_slots(typename Op::State (&acc)[S]) {
#pragma unroll
  for (int w = S / 2; w > 0; w /= 2)
#pragma unroll
    for (int j = 0; j < w; ++j) acc[j] = Op::merge(acc[j], acc[j + w]);
  return acc[0];
}

// The element value that Op::add leaves a state unchanged with: the identity's value.
template <class Op>
__device__ __forceinline__ auto identity_value() {
  if constexpr (Op::kIndex) return Op::identity().v;
  else return Op::identity();
}

// The generic loop of add_span (below). A thread's packs rarely divide into rounds of U: its
// last round is partial, by different amounts across a warp's lanes.
// - sum, mean, max, min (a 4-byte state, any T) and float32 argmax/argmin: every round loads U
//   packs at once, a partial one too (its last pack repeated, the repeats adding the identity's
//   value), and a warp takes the partial round's code whenever one of its lanes needs it, so its
//   lanes do not run a whole round and then a tail in turn; both codes give the same bits on a
//   whole round. A single remaining pack keeps its one load. Until session 22 these ops ended in a
//   tail of one pack at a time (two for float32 sum/max/min and 16-bit max/min), one or two loads
//   in flight for up to U - 1 packs. H100, session 22 runs 2-4, same-run A/B, µs: bf16 4096x32001
//   (256 threads x 15.6 packs) sum 92.9 -> 85.8, max 96.8 -> 85.7; float32 sum 176.8 -> 169.4, max
//   180.1 -> 169.8, argmax 176.1 -> 173.1; bf16 131072x500 sum 54.4 -> 47.1; 64x1048575 -1 µs;
//   float32 1024x50257 (3 whole rounds and at most one pack) +0.3-0.5, the rounds' vote.
// - float32 logsumexp, float64: the tail one pack at a time (not measured with the round).
//   Predicated tails once cost registers: float32 argmax 16384x4096 90.9 -> 96.5 µs with 8 more
//   (session 9; the round above keeps it at 56-64), and they spilled the 80-register 16-bit arg
//   kernels, which have their own loop now (reduce_fast16.cuh).
// The additions keep their order, so results do not change.
template <class Op, class T, int P, bool V, int U, int S, class Idx>
__device__ __forceinline__ void add_span_generic(typename Op::State& s, const T* x, Idx begin, Idx end, int t,
                                                 int nthreads) {
  typename Op::State acc[S];
#pragma unroll
  for (int j = 0; j < S; ++j) acc[j] = Op::identity();
  const Idx stride = static_cast<Idx>(nthreads) * P;
  Idx c = begin + static_cast<Idx>(t) * P;
  const auto add_pack = [&](const Pack<T, P>& pk, Idx at) {
#pragma unroll
    for (int j = 0; j < P; ++j) Op::add(acc[j % S], to_acc(pk.v[j]), at + j);
  };
  if constexpr (sizeof(typename Op::State) == 4 || (Op::kIndex && sizeof(T) == 4)) {
    // q walks with c: the round's base address is not rebuilt from the row offset (ptxas did,
    // ~10 instructions a round, inside the vote's convergence region).
    for (const T* q = x + c; c < end; c += U * stride, q += U * stride) {
      const Idx rem = end - c;
      Pack<T, P> pk[U];
      if (__all_sync(__activemask(), rem > (U - 1) * stride)) {
#pragma unroll
        for (int u = 0; u < U; ++u) pk[u] = load_pack_v<T, P, V>(q + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) add_pack(pk[u], c + u * stride);
      } else if (rem <= stride) {  // one pack: one load, not U (1024x50257: 24.5 packs a thread)
        add_pack(load_pack_v<T, P, V>(q), c);
      } else {
        const int last = round_last<U>(rem, stride);
        load_round(pk, q, stride, last, [](const T* a) { return load_pack_v<T, P, V>(a); });
        // The repeats add the identity, which leaves every state bit-identical (sum: the state is
        // never -0, so + 0 changes nothing; max/min: the NaN-propagating compare keeps it). Adding
        // it unconditionally keeps the last load in the round: under `if (u <= last)` ptxas moved
        // pack U - 1's load behind the other packs' adds, two latencies for the warp.
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < P; ++j)
            Op::add(acc[j % S], u <= last ? to_acc(pk[u].v[j]) : identity_value<Op>(), c + u * stride + j);
      }
    }
  } else {
    for (; c + (U - 1) * stride < end; c += U * stride) {
      Pack<T, P> pk[U];
#pragma unroll
      for (int u = 0; u < U; ++u) pk[u] = load_pack_v<T, P, V>(x + c + u * stride);
#pragma unroll
      for (int u = 0; u < U; ++u) add_pack(pk[u], c + u * stride);
    }
    for (; c < end; c += stride) add_pack(load_pack_v<T, P, V>(x + c), c);  // the last < U packs
  }
  s = Op::merge(s, fold_slots<Op, S>(acc));
}

// Adds x[begin, end) (begin, end and the stride multiples of P) element-wise-strided over the
// threads of a group: thread `t` of `nthreads` takes packs t, t + nthreads, ...
// Element j of every pack goes to state acc[j % S], so consecutive updates are independent
// (no P-long dependency chain per pack: matters for arg/logsumexp, whose add is a long
// compare/select or expf chain); the slots are folded by a fixed tree at the end, so the
// result is still one fixed function of the input (bit-deterministic). Each slot sees its
// elements in increasing index order, as the arg ops' tie rule assumes of add().
// 16-byte packs of bf16/f16 take the packed arg/logsumexp loops of reduce_fast16.cuh instead.
// Idx is int where the span is known to fit (warp rows, warp_rows): fewer registers.
// kRing (aligned x only): `ring` is this thread's first slot of a kRowRingStages-stage ring for
// the packed arg loop (arg16_stream_ring; slot i at ring[i * kBlockThreads], blocks of
// kBlockThreads threads); otherwise the register loop.
template <class Op, class T, int P, bool V, class Idx = int64_t, int U = unroll_for<Op, T, P>(), bool kRing = false>
__device__ __forceinline__ void add_span(typename Op::State& s, const T* x, Idx begin, Idx end, int t,
                                         int nthreads, uint4* ring = nullptr) {
  constexpr int S = slots_for<P>();
  if constexpr (arg16_path<Op, T, P>()) {  // packed bf16/f16 loops (reduce_fast16.cuh)
    const Idx stride = static_cast<Idx>(nthreads) * P, first = begin + static_cast<Idx>(t) * P;
    if (first < end) {
      typename Op::State st[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) st[j] = Op::identity();
      const Idx count = (end - first + stride - 1) / stride;
      if constexpr (kRing && uses_ring<Op, T, P, V>())  // count < 2^31: launch_rows
        arg16_stream_ring<Op, T, kBlockThreads, kRowRingStages, Idx>(st, x + first, static_cast<int>(count), stride,
                                                                     first, stride, 1, ring);
      else
        arg16_stream<Op, T, U, V, Idx>(st, x + first, count, stride, first, stride, 1);
      s = Op::merge(s, fold_slots<Op, 8>(st));
    }
  } else if constexpr (lse16_path<Op, T, P>()) {
    lse16_span<Op, T, U, V, Idx>(s, x, begin + static_cast<Idx>(t) * P, end, static_cast<Idx>(nthreads) * P);
  } else if constexpr (ext16_path<Op, T, P>()) {
    const Idx stride = static_cast<Idx>(nthreads) * P, first = begin + static_cast<Idx>(t) * P;
    if (first < end) {
      typename Op::State st[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) st[j] = Op::identity();
      ext16_stream<Op, T, U, V, Idx>(st, x + first, (end - first + stride - 1) / stride, stride);
      s = Op::merge(s, fold_slots<Op, 8>(st));
    }
  } else {
    add_span_generic<Op, T, P, V, U, S, Idx>(s, x, begin, end, t, nthreads);
  }
}

// Rows that are not whole packs (kPeel: n % P != 0, so row starts fall between packs): the
// row span [begin, end) at logical offset `base` (= row * n) splits into a head up to the first
// pack boundary of base + i, whole packs (vector loads), and a tail of < P elements. Boundaries
// come from the logical offset, never the address, so a misaligned operand (V == false) peels the
// same elements and gets the same bits. Until session 16 such rows took element loads (up to
// 1.45x XLA's time: bf16 argmax 8192x8191 71.9 vs 49.7 µs; now 59.0). A thread's head and tail
// elements are loaded before the packs and added after them, so their latency hides behind the
// packs' (bf16 argmax 16384x4095 60.7 -> 57.0 µs, 8192x8191 63.7 -> 59.0 against loading them
// in turn; float32 unchanged within noise; session 16 runs 9-10); they are added out of index
// order, so the arg ops merge them (add_unordered), as their add() assumes rising indices. float32 argmax/argmin on
// short odd rows ran ~10 % slower than with element loads (16384x4095 96.7 -> 108.7 µs, 8192x8191
// 97.9 -> 107.1, session 16 runs 9-10) until session 19 cut the arg compare chain (87.9 / 87.2,
// XLA 88.4 / 87.7): the cost was the compare chain, not the loads. The ring kernels
// (chunks >= 32768) add in order: holding the two elements there spilled.
template <class Op, class T, int P, bool V, class Idx, int U, bool kRing, bool kPeel>
__device__ __forceinline__ void add_row_span(typename Op::State& s, const T* xr, int64_t base, Idx begin, Idx end,
                                             int t, int nthreads, uint4* ring = nullptr) {
  if constexpr (!kPeel) {
    add_span<Op, T, P, V, Idx, U, kRing>(s, xr, begin, end, t, nthreads, ring);
  } else {
    const Idx skip = static_cast<Idx>((P - (base + begin) % P) % P);
    const Idx body = end - begin > skip ? begin + skip : end;
    const Idx body_end = body + (end - body) / P * P;
    if constexpr (kRing) {  // chunks of >= 32768: the latencies are amortised, registers are not
      for (Idx i = begin + t; i < body; i += nthreads) Op::add(s, to_acc(xr[i]), i);
      if (body < body_end) add_span<Op, T, P, V, Idx, U, kRing>(s, xr, body, body_end, t, nthreads, ring);
      for (Idx i = body_end + t; i < end; i += nthreads) Op::add(s, to_acc(xr[i]), i);
    } else {
      // The head and tail elements, one a thread (head element i on thread i, tail element i on
      // thread head + i), so no thread adds two in turn while its warp waits: a row of
      // n % P == P - 1 has P - 1 of them, which thread i took both of before session 21 (one
      // logsumexp add is ~40 instructions). Groups narrower than them (warp rows of 2-4 lanes)
      // take the rest in turn.
      const Idx head = body - begin, loose = head + (end - body_end);
      const auto at = [&](Idx i) { return i < head ? begin + i : body_end + (i - head); };
      const T v = t < loose ? xr[at(t)] : T();
      if (body < body_end) add_span<Op, T, P, V, Idx, U, kRing>(s, xr, body, body_end, t, nthreads, ring);
      if (t < loose) add_unordered<Op>(s, to_acc(v), at(t));
      for (Idx i = t + nthreads; i < loose; i += nthreads) add_unordered<Op>(s, to_acc(xr[at(i)]), at(i));
    }
  }
}

}  // namespace jaxops::reduce::kernels
