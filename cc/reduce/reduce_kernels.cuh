// CUDA kernels of the reduction family, templated on the operator (reduce_ops.h) and the
// element type, plus the launcher that picks one by shape. Included by one .cu per operator
// group so the instantiations compile in parallel.
//
// Every op runs on an (outer, reduced, inner) view:
//   inner == 1 (row reduction):  8-32 lanes per row (short rows), block per row, or a grid split of
//                                each row into `splits` chunks whose partial states go to the
//                                workspace and are merged by merge_kernel in a fixed order;
//   inner > 1 (column reduction): a block tile of TX threads x P columns (16-byte loads across
//                                the row) by TY threads down the reduced axis; the reduced axis
//                                may be split into chunks merged the same way.
// No atomics: each output is a fixed tree over a fixed partition, so results are bit-identical
// from call to call on a given device and launch plan (the plan comes from the Python side).
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "reduce/reduce_cuda.h"
#include "reduce/reduce_fast16.cuh"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce::kernels {

using cuda::acc_t;
using cuda::load_pack;
using cuda::Pack;
using cuda::to_acc;

constexpr int kMinRowLanes = 2;      // see row_warp_kernel
constexpr int kBlockThreads = 256;   // column / merge kernels
constexpr int kMaxGrid = INT_MAX;

template <class Op>
__device__ __forceinline__ typename Op::State warp_merge(typename Op::State s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) s = Op::merge(s, cuda::shfl_xor(s, offset));
  return s;
}

// Block-wide merge (blockDim.x a multiple of 32); the result is valid in thread 0.
template <class Op>
__device__ __forceinline__ typename Op::State block_merge(typename Op::State s) {
  using S = typename Op::State;
  __shared__ S warp_states[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  s = warp_merge<Op>(s);
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < nwarps ? warp_states[lane] : Op::identity();
    s = warp_merge<Op>(s);
  }
  __syncthreads();  // warp_states may be reused by the next grid-stride iteration
  return s;
}

// Lanes that share one output in the block folds below: min(threads / outputs, 32). Both are
// powers of two, so either every warp holds 32 / G whole outputs (G < 32) or one (G == 32).
__device__ __forceinline__ int fold_lanes(int outputs, int threads) {
  const int g = threads / outputs;
  return g < 32 ? g : 32;
}

// One-barrier replacement of a log2(rows)-level shared-memory tree: smem holds `rows` x
// `outputs` states ([row][output]); output `out` is folded by G lanes (lane g takes rows g,
// g + G, ... in order), then an xor-shuffle tree over the G lanes. Fixed order: deterministic.
// Warp-uniform by fold_lanes (an inactive warp has every lane's out >= outputs). Valid in g == 0.
template <class Op>
__device__ __forceinline__ typename Op::State fold_rows(const typename Op::State* smem, int outputs, int rows,
                                                        int out, int g, int G) {
  auto a = Op::identity();
  if (out < outputs) {
    for (int k = g; k < rows; k += G) a = Op::merge(a, smem[k * outputs + out]);
    for (int offset = G / 2; offset > 0; offset /= 2) a = Op::merge(a, cuda::shfl_xor(a, offset));
  }
  return a;
}

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

// Writes a finished result (or, with `ws`, the partial state) for output `at`.
template <class Op, class T>
__device__ __forceinline__ void emit(void* y, typename Op::State* ws, int64_t at,
                                     const typename Op::State& s, int64_t count) {
  if (ws != nullptr) {
    ws[at] = s;
  } else if constexpr (Op::kIndex) {
    static_cast<int32_t*>(y)[at] = Op::finish(s, count);
  } else {
    static_cast<T*>(y)[at] = cuda::from_acc<T>(Op::finish(s, count));
  }
}

// float32 with a 4-byte state (sum, mean, max, min) in 16-byte packs: 8 packs (128 B) in flight
// per thread under >= 4 blocks of 256 (<= 64 registers; 1024 threads x 128 B = 128 KB per SM
// instead of 1280 x 64 B). Session 4, H100: 0.5-2 % faster than 4 packs on rows, full and
// columns (sum 16384x4096 88.4 -> 87.8 µs, sum_cols 262144x256 93.5 -> 91.9).
template <class Op, class T, int P>
constexpr bool f32_wide() {
  return sizeof(T) == 4 && sizeof(typename Op::State) == 4 && P * sizeof(T) == 16;
}

// float32 argmax/argmin in 16-byte packs: 8 packs in flight per thread too, under >= 3 blocks of
// 256 (row_block 60-64 registers, columns 80; row_warp keeps 4, see warp_unroll). Session 14,
// H100, same-run A/B against 4 packs: rows 4096x16384 91.5 -> 89.5 µs, 1024x65536 92.6 -> 90.7,
// full 95.4 -> 93.6, argmax_cols 1048576x64 99.6 -> 98.8; 64x2^20 (one wave of 512-thread
// blocks) 93.4 -> 95.0, also 94.8 on ~1024 blocks; the rest unchanged.
template <class Op, class T, int P>
constexpr bool f32_arg8() {
  return sizeof(T) == 4 && Op::kIndex && P * sizeof(T) == 16;
}

// Independent packs in flight per thread: 8 for 2-byte types, f32_wide and f32_arg8 (128 B),
// else 4 (64 B; f64: 4 x 16 B). Two-byte types carry twice the elements per byte, so with the
// same pack count a thread would have half the bytes in flight of float32 for the same
// per-element work. The generic arg loop on 2-byte types (8 elements a pack) is the exception:
// its per-element compare/select/index work made 8 packs compute-bound (session 3, H100: bf16
// argmax rows fell from 0.68-0.83 to 0.54-0.64 of copy); float32 packs hold 4 elements
// (f32_arg8); the packed 2-byte arg loop (reduce_fast16.cuh, ~3 instructions an element) takes 8
// (4 packs under >= 4 blocks lost 1-24 % on rows in session 4).
template <class Op, class T, int P>
constexpr int unroll_for() {
  return (sizeof(T) <= 2 && (!Op::kIndex || arg16_types<Op, T, P>())) || f32_wide<Op, T, P>() ||
                 f32_arg8<Op, T, P>()
             ? 8
             : 4;
}

// Packs in flight per lane of row_warp_kernel: float32 arg keeps 4 there, since 8 meant fewer
// lanes per short row and lost 1-2 % (session 14, H100: 524288x128 90.7 -> 92.4 µs, 262144x256
// 89.3 -> 90.4, 131072x512 88.3 -> 89.4; 1024-4096 columns unchanged).
template <class Op, class T, int P>
constexpr int warp_unroll() {
  return f32_arg8<Op, T, P>() ? 4 : unroll_for<Op, T, P>();
}

// Launch bounds. Without them ptxas keeps the 2-byte kernels near 32 registers by issuing
// each 16-byte load right before its use, i.e. about one load in flight per thread (seen in
// the SASS of the bf16 column kernel: load, use, load, use). Promising fewer resident blocks
// lets it hold all unroll_for<Op, T, P>() packs at once: 2-byte types get <= 80 registers at 256
// threads (>= 3 blocks, 768 threads x 128 B = 96 KB in flight per SM). 4-byte types with a
// 4-byte state (sum, max) keep <= 48 (>= 5 blocks, 1280 x 64 B) for single-element loads and
// <= 64 (>= 4 blocks, 1024 x 128 B) with 16-byte packs (f32_wide), wider states (logsumexp,
// arg) <= 64 (>= 4 blocks), float32 arg in 16-byte packs <= 80 (>= 3 blocks, f32_arg8): near the
// unhinted counts, without spills. float64 gets <= 128
// (its software exp in logsumexp spills at 64). Rows of 2-byte types never use 512-thread
// blocks (max_row_block_threads), which would halve the register budget.
constexpr int min_blocks_for(int element_bytes, int state_bytes, int threads) {
  const int blocks_of_256 = element_bytes <= 2 ? 3 : element_bytes >= 8 ? 2 : state_bytes == 4 ? 5 : 4;
  return (blocks_of_256 * 256 + threads - 1) / threads;  // rounded up: 512 threads keep >= as many threads
}
// V == false (element loads for a misaligned base, see load_pack_v): a 16-byte pack is P loads
// into P registers, so the budgets above spill (ptxas: up to 76 bytes in the bf16 arg/logsumexp
// kernels, 4 in f32 max columns); those variants promise >= 2 blocks (<= 128 registers) instead.
// Occupancy only: the tiles and the order of operations stay those of the vector-load kernel.
template <class Op, class T, int P, bool V = true>
constexpr int min_blocks(int threads) {
  if constexpr (!V && P > 1) return (2 * 256 + threads - 1) / threads;
  else if constexpr (f32_wide<Op, T, P>()) return (4 * 256 + threads - 1) / threads;
  else if constexpr (f32_arg8<Op, T, P>()) return (3 * 256 + threads - 1) / threads;
  else return min_blocks_for(static_cast<int>(sizeof(T)), static_cast<int>(sizeof(typename Op::State)), threads);
}
template <class T>
constexpr int max_row_block_threads() {
  return sizeof(T) <= 2 ? 256 : 512;
}

// Packs a thread takes from one row (or chunk of a split row) of 16-byte packs: the unroll, so a
// row is read in one round of loads (a 4096-long float32 row by 128 threads, 8192 bf16 by 128),
// except float32 logsumexp, whose 4-pack loop and expf-heavy block merge want fewer, longer
// threads. Until session 16 every block row had 256 threads and rows up to 4096 elements a warp:
// bf16 rows of 4097-16383 elements then left each thread fewer packs than the unroll, all in the
// one-pack-at-a-time tail. H100, session 16 run 5, µs, same-run A/B: 8192x8192 bf16 (256 -> 128
// threads) sum 49.6 -> 43.9, max 48.0 -> 44.0, logsumexp 91.0 -> 45.8, argmax 88.3 -> 45.9 (XLA
// 43.3-47.4); 16384x6000 bf16 argmax 148.4 -> 88.3, float32 192.0 -> 139.6; 8192x8192 float32
// logsumexp 96.5 -> 91.4. 16384x4096 float32 (a warp -> a block of 128): sum 85.6 -> 85.3, max
// 86.0 -> 85.5, argmax 88.5 -> 88.0 (XLA 85.6), on the hosts of runs 2-4 87.8 -> 86.1, 88.2 ->
// 86.2, 90.9 -> 88.2 (XLA 85.5 / 85.5 / 86.3).
template <class Op, class T, int P>
constexpr int row_packs_per_thread() {
  return sizeof(T) == 4 && !Op::kIndex && sizeof(typename Op::State) == 8 ? 32 : unroll_for<Op, T, P>();
}

// Whether unsplit rows of n elements go to row_warp_kernel: those one warp reads in one round.
template <class Op, class T, int P>
bool warp_rows(int64_t n) {
  return (n + P - 1) / P <= 32 * row_packs_per_thread<Op, T, P>();
}

// Threads of a row_block_kernel launch for chunks of `chunk` elements: the largest power of two
// in [32, max_row_block_threads<T>()] that leaves each thread row_packs_per_thread packs. Below
// 32768-element chunks float32 arg stops at 256 (4096x16384 with 512: 89.4 -> 90.2 µs, where sum
// and max gained 0.6).
template <class Op, class T, int P>
int row_block_threads(int64_t chunk) {
  const int64_t packs = (chunk + P - 1) / P, per_thread = row_packs_per_thread<Op, T, P>();
  const int most = f32_arg8<Op, T, P>() && chunk < 32768 ? 256 : max_row_block_threads<T>();
  int threads = 32;
  while (threads < most && threads * 2 * per_thread <= packs) threads *= 2;
  return threads;
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

// The packed arg loop's shared-memory ring (arg16_stream_ring) in row_block_kernel (kRing): aligned
// 16-byte packs of 2-byte types on sm_90+ (arg16_path; the host asks with arg16_types, as it
// cannot see the device's path), blocks of kBlockThreads with at least kRingMinPacks packs a
// thread (chunks of >= 32768 elements). H100, session
// 15 (runs 3-7, same-run A/B against the register loop, bf16 argmax, µs): 1024x65536 48.9 -> 47.0,
// 64x2^20 52.7 -> 50.0, full 51.9 -> 50.1 with 4 stages (3 stages: 47.5 / 50.6 / 50.5; 2: 47.9 /
// 51.0 / 50.8), 16384x4096 (a warp a row, 16 packs a lane) 48.8 -> 47.3, since session 16 blocks
// of 64 threads with 8 packs each and no ring, 46.2; 4096x16384 (8 packs a thread) 46.9 -> 47.7
// through the ring, hence the minimum. The column kernel keeps the register
// loop: through a 2-stage ring (16 KB of fold states plus a 4-stage ring leave 2 blocks an SM)
// argmax_cols moved 54.0 -> 53.6 (1048576x64), 54.5 -> 54.3 (262144x256), 52.5 -> 53.6 (16384x4096).
constexpr int kRowRingStages = 4;
constexpr int kRingMinPacks = 16;

// Whether a row launch streams through the ring (a function of the plan): chunks of `chunk`
// elements over `threads` threads of P-element packs, whose count a thread still fits the ring's
// 32 bits.
constexpr bool ring_rows(int64_t chunk, int threads, int P) {
  const int64_t packs = chunk / (int64_t(threads) * P);
  return packs >= kRingMinPacks && packs < INT_MAX;
}

template <class Op, class T, int P, bool V>
__host__ __device__ constexpr bool uses_ring() {
#if defined(__CUDA_ARCH__)
  return V && arg16_path<Op, T, P>();
#else
  return V && arg16_types<Op, T, P>();
#endif
}

// Launches Plain, or Ring (same arguments) with the ring's shared memory when `ring`.
template <auto Plain, auto Ring, class... Args>
cudaError_t launch_row_kernel(bool ring, dim3 grid, int threads, cudaStream_t stream, Args... args) {
  if (!ring) return cuda::launch_kernel(Plain, grid, threads, 0, stream, args...);
  const size_t smem = size_t(threads) * kRowRingStages * kRingPacks * 16;
  if (cudaError_t err = cuda::allow_dynamic_smem(Ring, smem)) return err;
  return cuda::launch_kernel(Ring, grid, threads, smem, stream, args...);
}

// The generic loop of add_span (below). Rows whose packs do not divide into U a lane end in a
// tail, and a pack-at-a-time tail keeps one load in flight. float32 sum/max/min/mean (f32_wide)
// and the packed 16-bit max/min (ext16_stream) load their tail kTailPacks packs at a time before
// use (session 9, H100, 524288x128 with 8 lanes a row, i.e. 4 packs a lane: f32 sum 106.5 -> 91.5
// us, max 107.8 -> 93.0; bf16 max 80.6 -> 63.8; 128-column rows have since moved to 2-4 lanes and
// no tail, see row_warp_kernel). Not everywhere: the same tail made bf16 sum slower (61.7 -> 66.8)
// and float32 argmax 16384x4096 (no tail at all, but 8 more registers) 90.9 -> 96.5; tails of
// U / 2 or U predicated packs spilled the 80-register 16-bit arg kernels. The additions keep their
// order, so results do not change.
template <class Op, class T, int P, bool V, int U, int S, class Idx>
__device__ __forceinline__ void add_span_generic(typename Op::State& s, const T* x, Idx begin, Idx end, int t,
                                                 int nthreads) {
  typename Op::State acc[S];
#pragma unroll
  for (int j = 0; j < S; ++j) acc[j] = Op::identity();
  const Idx stride = static_cast<Idx>(nthreads) * P;
  Idx c = begin + static_cast<Idx>(t) * P;
  for (; c + (U - 1) * stride < end; c += U * stride) {
    Pack<T, P> pk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) pk[u] = load_pack_v<T, P, V>(x + c + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < P; ++j) Op::add(acc[j % S], to_acc(pk[u].v[j]), c + u * stride + j);
  }
  constexpr int kTail = f32_wide<Op, T, P>() ? kTailPacks : 1;
  for (; c < end; c += kTail * stride) {  // the last < U packs
    Pack<T, P> pk[kTail];
#pragma unroll
    for (int u = 0; u < kTail; ++u)
      if (c + u * stride < end) pk[u] = load_pack_v<T, P, V>(x + c + u * stride);
#pragma unroll
    for (int u = 0; u < kTail; ++u)
      if (c + u * stride < end)
#pragma unroll
        for (int j = 0; j < P; ++j) Op::add(acc[j % S], to_acc(pk[u].v[j]), c + u * stride + j);
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
// in turn; float32 unchanged within noise; session 16 runs 9-10). Still open: float32 argmax/argmin
// on short odd rows runs ~10 % slower than the element loads did (16384x4095 96.7 -> 108.7 µs,
// 8192x8191 97.9 -> 107.1, session 16 runs 9-10; the SASS keeps its 8 loads up front and a
// wider tail changed nothing), while their split rows gained (64x1048575 117.0 -> 99.7). The ring
// kernels (chunks >= 32768) add in order: holding the two elements there spilled. The arg ops
// break ties by index in every add and merge, so the order is free.
template <class Op, class T, int P, bool V, class Idx, int U, bool kRing, bool kPeel>
__device__ __forceinline__ void add_row_span(typename Op::State& s, const T* xr, int64_t base, Idx begin, Idx end,
                                             int t, int nthreads, uint4* ring = nullptr) {
  if constexpr (!kPeel) {
    add_span<Op, T, P, V, Idx, U, kRing>(s, xr, begin, end, t, nthreads, ring);
  } else {
    const Idx skip = static_cast<Idx>((P - (base + begin) % P) % P);
    const Idx body = end - begin > skip ? begin + skip : end;
    const Idx body_end = body + (end - body) / P * P;
    const Idx h = begin + t, e = body_end + t;
    if constexpr (kRing) {  // chunks of >= 32768: the latencies are amortised, registers are not
      for (Idx i = h; i < body; i += nthreads) Op::add(s, to_acc(xr[i]), i);
      if (body < body_end) add_span<Op, T, P, V, Idx, U, kRing>(s, xr, body, body_end, t, nthreads, ring);
    } else {
      const T hv = h < body ? xr[h] : T(), ev = e < end ? xr[e] : T();
      if (body < body_end) add_span<Op, T, P, V, Idx, U, kRing>(s, xr, body, body_end, t, nthreads, ring);
      if (h < body) Op::add(s, to_acc(hv), h);
      if (e < end) Op::add(s, to_acc(ev), e);
      // Groups narrower than the head or tail (warp rows of 2-4 lanes) take the rest in turn.
      for (Idx i = h + nthreads; i < body; i += nthreads) Op::add(s, to_acc(xr[i]), i);
    }
    for (Idx i = kRing ? e : e + nthreads; i < end; i += nthreads) Op::add(s, to_acc(xr[i]), i);
  }
}

// inner == 1, short rows: `group` lanes per row (a power of two, 2..32), 32 / group rows per
// warp. Short rows get fewer lanes so each lane still has warp_unroll<Op, T, P>() packs in flight
// (a 1024-long bf16 row is 128 packs: 16 lanes x 8, two rows per warp; a 128-long one 2 lanes x
// 8, sixteen rows per warp). A warp load then covers 16 rows x 32 B: whole sectors, all used.
// Sessions 1-8 kept >= 8 lanes for 128-byte segments a row, which left 128- and 256-column rows
// with 1-4 packs a lane (session 9, H100, bf16 524288x128 / 262144x256 with 8 -> 2 lanes: sum
// 61.6 -> 50.7 / 56.2 -> 45.9 us, max 63.7 -> 50.4 / 51.2 -> 46.2, logsumexp 116.5 -> 49.8 /
// 87.8 -> 47.3, argmax 119.1 -> 51.3 / 87.7 -> 48.0; float32 unchanged within 1 %; 4 lanes sat
// in between). Group merges use xor shuffles with offsets < group, which stay inside the
// aligned group of lanes.
template <class Op, class T, int P, bool V, bool kPeel = false>
__global__ void __launch_bounds__(256, min_blocks<Op, T, P, V>(256))
    row_warp_kernel(const T* __restrict__ x, void* y, int64_t rows, int64_t n, int group) {
  cuda::enter_kernel();
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int per_warp = 32 / group;
  for (int64_t row0 = (static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32) * per_warp; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * warps * per_warp) {  // warp-uniform loop
    const int64_t row = row0 + lane / group;
    auto s = Op::identity();
    if (row < rows)
      add_row_span<Op, T, P, V, int, warp_unroll<Op, T, P>(), false, kPeel>(s, x + row * n, row * n, 0,
                                                                            static_cast<int>(n), lane % group, group);
    for (int offset = group / 2; offset > 0; offset /= 2) s = Op::merge(s, cuda::shfl_xor(s, offset));
    if (lane % group == 0 && row < rows) emit<Op, T>(y, nullptr, row, s, n);
  }
}

// inner == 1: block b = row * splits + split reduces x[row, split*chunk : (split+1)*chunk].
// With ws it writes the partial state ws[b] (merged by merge_kernel); otherwise (splits == 1)
// the finished y[row].
template <class Op, class T, int P, bool V, bool kRing = false, bool kPeel = false>
__global__ void __launch_bounds__(max_row_block_threads<T>(), min_blocks<Op, T, P, V>(max_row_block_threads<T>()))
    row_block_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t rows, int64_t n,
                     int64_t splits, int64_t chunk) {
  cuda::enter_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];  // kRing: the ring (launch_row_kernel)
  uint4* const ring = kRing ? reinterpret_cast<uint4*>(smem_raw) + threadIdx.x : nullptr;
  for (int64_t b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    const int64_t row = b / splits, split = b % splits;
    const int64_t begin = split * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    auto s = Op::identity();
    if (begin < end)
      add_row_span<Op, T, P, V, int64_t, unroll_for<Op, T, P>(), kRing, kPeel>(s, x + row * n, row * n, begin, end,
                                                                                threadIdx.x, blockDim.x, ring);
    s = block_merge<Op>(s);
    if (threadIdx.x == 0) emit<Op, T>(y, ws, b, s, n);
  }
}

// inner > 1. Block (TX, TY); block b = (o * splits + split) * tiles + tile covers columns
// [tile*TX*P, ...) of rows [split*chunk, ...) of slab o. Thread (tx, ty) keeps P column states
// over rows ty, ty + TY, ...; the TY states per column are folded through shared memory.
// With ws (splits > 1) it writes partial states ws[o, split, c], merged by merge_kernel.
template <class Op, class T, int P, bool V>
__global__ void __launch_bounds__(256, min_blocks<Op, T, P, V>(256))
    column_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t outer, int64_t n,
                  int64_t inner, int64_t splits, int64_t chunk, int64_t tiles) {
  cuda::enter_kernel();
  using S = typename Op::State;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* smem = reinterpret_cast<S*>(smem_raw);  // [TY][TX * P]
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  for (int64_t b = blockIdx.x; b < outer * splits * tiles; b += gridDim.x) {
    const int64_t tile = b % tiles, os = b / tiles, split = os % splits, o = os / splits;
    const int64_t col = (tile * TX + tx) * P;
    const int64_t begin = split * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    S s[P];
#pragma unroll
    for (int j = 0; j < P; ++j) s[j] = Op::identity();
    if constexpr (arg16_path<Op, T, P>()) {  // packed bf16/f16 loop (reduce_fast16.cuh)
      const int64_t r0 = begin + ty;
      if (col < inner && r0 < end)
        arg16_stream<Op, T, unroll_for<Op, T, P>(), V, int64_t>(s, x + (o * n + r0) * inner + col,
                                                             (end - r0 + TY - 1) / TY, static_cast<int64_t>(TY) * inner,
                                                             r0, TY, 0);
    } else if constexpr (ext16_path<Op, T, P>()) {
      const int64_t r0 = begin + ty;
      if (col < inner && r0 < end)
        ext16_stream<Op, T, unroll_for<Op, T, P>(), V, int64_t>(
            s, x + (o * n + r0) * inner + col, (end - r0 + TY - 1) / TY, static_cast<int64_t>(TY) * inner);
    } else if (col < inner) {
      const T* xo = x + o * n * inner + col;
      constexpr int U = unroll_for<Op, T, P>();  // rows in flight per thread (16 B each when P > 1)
      int64_t r = begin + ty;
      for (; r + (U - 1) * TY < end; r += U * TY) {
        Pack<T, P> pk[U];
#pragma unroll
        for (int u = 0; u < U; ++u) pk[u] = load_pack_v<T, P, V>(xo + (r + u * TY) * inner);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk[u].v[j]), r + u * TY);
      }
      for (; r < end; r += TY) {
        const Pack<T, P> pk = load_pack_v<T, P, V>(xo + r * inner);
#pragma unroll
        for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk.v[j]), r);
      }
    }
    // The TY states of each of the O = TX * P columns: one barrier, then G lanes per column
    // (fold_rows) instead of a log2(TY)-level tree with a barrier per level.
    const int O = TX * P, t = ty * TX + tx, G = fold_lanes(O, TX * TY), out = t / G, g = t % G;
#pragma unroll
    for (int j = 0; j < P; ++j) smem[ty * O + tx * P + j] = s[j];
    __syncthreads();
    const S r = fold_rows<Op>(smem, O, TY, out, g, G);
    const int64_t c = tile * O + out;  // this lane's column when g == 0 and out < O
    if (g == 0 && out < O && c < inner) emit<Op, T>(y, ws, (o * splits + split) * inner + c, r, n);
    __syncthreads();  // smem is rewritten by the next grid-stride iteration
  }
}

// Merges ws[o, 0..splits, i] into y[o, i] in a fixed order: thread (tx, ty) folds splits
// ty, ty + TY, ... of column tile*TX + tx, then fold_rows over ty. The second kernel of every
// split launch: a fused last-block merge (session 5: arrival counters, atomicInc,
// __threadfence) measured 1-4 µs slower on columns and equal on rows on the H100, and its
// shared counters would be unsafe for concurrent launches on two streams, so it was removed.
template <class Op, class T>
__global__ void merge_kernel(const typename Op::State* __restrict__ ws, void* y, int64_t outer,
                             int64_t splits, int64_t inner, int64_t tiles, int64_t count) {
  cuda::enter_kernel();
  using S = typename Op::State;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* smem = reinterpret_cast<S*>(smem_raw);  // [TY][TX]
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  for (int64_t b = blockIdx.x; b < outer * tiles; b += gridDim.x) {
    const int64_t o = b / tiles, col = (b % tiles) * TX + tx;
    S s = Op::identity();
    if (col < inner) {
      const S* wc = ws + o * splits * inner + col;
      int64_t k = ty;
      for (; k + 3 * TY < splits; k += 4 * TY) {  // four independent loads in flight
        S part[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) part[u] = wc[(k + u * TY) * inner];
#pragma unroll
        for (int u = 0; u < 4; ++u) s = Op::merge(s, part[u]);
      }
      for (; k < splits; k += TY) s = Op::merge(s, wc[k * inner]);
    }
    smem[ty * TX + tx] = s;
    __syncthreads();
    const int t = ty * TX + tx, G = fold_lanes(TX, TX * TY), out = t / G;
    const S r = fold_rows<Op>(smem, TX, TY, out, t % G, G);
    const int64_t c = (b % tiles) * TX + out;
    if (t % G == 0 && out < TX && c < inner) emit<Op, T>(y, nullptr, o * inner + c, r, count);
    __syncthreads();
  }
}

inline unsigned grid_for(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

inline int pow2_at_least(int64_t v, int cap) {
  int p = 1;
  while (p < v && p < cap) p *= 2;
  return p;
}

template <class Op, class T>
cudaError_t merge_partials(const typename Op::State* ws, void* y, const Plan& p, cudaStream_t stream) {
  // Narrow column tiles (<= 8) leave >= 32 lanes per column folding splits, so few columns
  // with many splits (a tall column reduction) still merge with plenty of parallelism.
  const int TX = pow2_at_least(p.inner, 8), TY = kBlockThreads / TX;
  const int64_t tiles = (p.inner + TX - 1) / TX;
  const size_t smem = sizeof(typename Op::State) * kBlockThreads;
  return cuda::launch_kernel(merge_kernel<Op, T>, grid_for(p.outer * tiles), dim3(TX, TY), smem, stream, ws, y, p.outer,
      p.splits, p.inner, tiles, p.reduced);
}

template <class Op, class T, int P, bool V, bool kPeel>
cudaError_t launch_rows(const T* x, void* y, typename Op::State* ws, const Plan& p, cudaStream_t stream) {
  const int64_t n = p.reduced;
  if (p.splits == 1 && warp_rows<Op, T, P>(n)) {
    constexpr int kWarps = 8;
    const int64_t packs = (n + P - 1) / P;
    int group = 32;
    while (group > kMinRowLanes && static_cast<int64_t>(group) * warp_unroll<Op, T, P>() > packs) group /= 2;
    const int64_t rows_per_block = kWarps * (32 / group);
    return cuda::launch_kernel(row_warp_kernel<Op, T, P, V, kPeel>,
                               grid_for((p.outer + rows_per_block - 1) / rows_per_block), kWarps * 32, 0, stream, x, y,
                               p.outer, n, group);
  }
  // Chunks are whole packs; chunk >= n / splits so `splits` chunks cover the row.
  int64_t chunk = (n + p.splits - 1) / p.splits;
  chunk = (chunk + P - 1) / P * P;
  const int threads = row_block_threads<Op, T, P>(chunk);
  const bool split = p.splits > 1;
  constexpr bool kRing = uses_ring<Op, T, P, V>();
  if (cudaError_t err = launch_row_kernel<row_block_kernel<Op, T, P, V, false, kPeel>,
                                          row_block_kernel<Op, T, P, V, kRing, kPeel>>(
          kRing && threads == kBlockThreads && ring_rows(chunk, threads, P), grid_for(p.outer * p.splits), threads,
          stream, x, y, split ? ws : nullptr, p.outer, n, p.splits, chunk);
      err != cudaSuccess || !split)
    return err;
  return merge_partials<Op, T>(ws, y, p, stream);
}

template <class Op, class T, int P, bool V>
cudaError_t launch_columns(const T* x, void* y, typename Op::State* ws, const Plan& p, cudaStream_t stream) {
  const int TX = pow2_at_least((p.inner + P - 1) / P, 32), TY = kBlockThreads / TX;
  const int64_t tiles = (p.inner + TX * P - 1) / (TX * P);
  const int64_t chunk = (p.reduced + p.splits - 1) / p.splits;
  const size_t smem = sizeof(typename Op::State) * P * kBlockThreads;
  const bool split = p.splits > 1;
  if (cudaError_t err = cuda::launch_kernel(column_kernel<Op, T, P, V>, grid_for(p.outer * p.splits * tiles),
      dim3(TX, TY), smem, stream, x, y, split ? ws : nullptr, p.outer, p.reduced, p.inner, p.splits, chunk,
      tiles); err != cudaSuccess || !split) return err;
  return merge_partials<Op, T>(ws, y, p, stream);
}

template <class Op, class T, int P, bool V>
cudaError_t launch_view(const T* x, typename Op::State* ws, const Plan& p, cudaStream_t stream) {
  if constexpr (P == 1) {  // columns whose width is not whole packs; rows always take packs
    return launch_columns<Op, T, P, V>(x, p.y, ws, p, stream);
  } else {
    if (p.inner > 1) return launch_columns<Op, T, P, V>(x, p.y, ws, p, stream);
    return p.reduced % P != 0 ? launch_rows<Op, T, P, V, true>(x, p.y, ws, p, stream)
                              : launch_rows<Op, T, P, V, false>(x, p.y, ws, p, stream);
  }
}

// Test hook: JAXOPS_REDUCE_ELEMENT_LOADS=1 runs 16-byte-packed plans with element loads even on
// an aligned operand (XLA hands out aligned buffers, so tests could not reach that path
// otherwise); tests/test_reductions.py checks the results are bit-identical to vector loads.
inline bool force_element_loads() {
  static const bool on = [] {
    const char* e = std::getenv("JAXOPS_REDUCE_ELEMENT_LOADS");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}

// Picks the kernel for one (Op, T). Packs are 16 bytes for rows and for columns whose width is a
// multiple of 16 bytes (a function of the shape only), otherwise single elements (no
// intermediate widths: fewer kernels). The base pointer's alignment picks only the load
// instruction (V): a 16-byte-packed plan on a misaligned operand runs the same tiles and
// the same order of operations with element loads, so results do not depend on the address.
template <class Op, class T>
cudaError_t launch(const Plan& p, cudaStream_t stream) {
  using S = typename Op::State;
  static_assert(sizeof(S) == 4 || sizeof(S) == 8 || sizeof(S) == 16, "state sizes match state_bytes()");
  if (p.outer * p.inner == 0) return cudaSuccess;
  constexpr int kPack = 16 / sizeof(T);
  const T* x = static_cast<const T*>(p.x);
  S* ws = static_cast<S*>(p.ws);
  // Rows always take 16-byte packs (rows that are not whole packs peel a head and a tail each:
  // add_row_span); columns whose width is not whole packs take elements.
  if (p.inner > 1 && p.inner % kPack != 0) return launch_view<Op, T, 1, true>(x, ws, p, stream);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && !force_element_loads())
    return launch_view<Op, T, kPack, true>(x, ws, p, stream);
  return launch_view<Op, T, kPack, false>(x, ws, p, stream);
}

}  // namespace jaxops::reduce::kernels

// Defines `cudaError_t NAME(const Plan&, cudaStream_t)` running OP_A<A> when p.kind == KIND_A
// and OP_B<A> otherwise, where OP_A / OP_B are alias templates on the accumulator type A.
#define JAXOPS_REDUCE_LAUNCHER(NAME, KIND_A, OP_A, OP_B)                                  \
  cudaError_t NAME(const Plan& p, cudaStream_t stream) {                                 \
    JAXOPS_DISPATCH_FLOAT(p.dtype, T, {                                                   \
      using A = ::jaxops::cuda::acc_t<T>;                                                 \
      return p.kind == KIND_A ? kernels::launch<OP_A<A>, T>(p, stream)                    \
                              : kernels::launch<OP_B<A>, T>(p, stream);                   \
    });                                                                                   \
    return cudaErrorInvalidValue;                                                         \
  }
