// The reduction launchers: the kernel, grid and block for a plan (rows, columns, split merges),
// and JAXOPS_REDUCE_LAUNCHER, which each reduce_*.cu instantiates for its operators so the
// instantiations compile in parallel.
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "reduce/reduce_cuda.h"
#include "reduce/reduce_kernels.cuh"
#include "reduce/reduce_plan.cuh"

namespace jaxops::reduce::kernels {

inline unsigned grid_for(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

inline int pow2_at_least(int64_t v, int cap) {
  int p = 1;
  while (p < v && p < cap) p *= 2;
  return p;
}

// Launches Plain, or Ring (same arguments) with the ring's shared memory when `ring`.
template <auto Plain, auto Ring, class... Args>
cudaError_t launch_row_kernel(bool ring, dim3 grid, int threads, cudaStream_t stream, Args... args) {
  if (!ring) return cuda::launch_kernel(Plain, grid, threads, 0, stream, args...);
  const size_t smem = size_t(threads) * kRowRingStages * kRingPacks * 16;
  if (cudaError_t err = cuda::allow_dynamic_smem(Ring, smem)) return err;
  return cuda::launch_kernel(Ring, grid, threads, smem, stream, args...);
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
  if (p.splits == 1 && warp_rows<Op, T, P>(n, p.fast_dram)) {
    constexpr int kWarps = 8;
    const int group = warp_row_group<Op, T, P>((n + P - 1) / P, p.fast_dram);
    const int64_t rows_per_block = kWarps * (32 / group);
    return cuda::launch_kernel(row_warp_kernel<Op, T, P, V, kPeel>,
                               grid_for((p.outer + rows_per_block - 1) / rows_per_block), kWarps * 32, 0, stream, x, y,
                               p.outer, n, group);
  }
  // Chunks are whole packs; chunk >= n / splits so `splits` chunks cover the row.
  int64_t chunk = (n + p.splits - 1) / p.splits;
  chunk = (chunk + P - 1) / P * P;
  const int threads = row_launch_threads<Op, T, P>(p.outer, p.splits, chunk, p.fast_dram);
  const bool split = p.splits > 1;
  constexpr bool kRing = uses_ring<Op, T, P, V>();
  const bool ring = kRing && threads == kBlockThreads && ring_rows(chunk, threads, P);
  typename Op::State* const partials = split ? ws : nullptr;
  // Rows that are not whole packs hold their head and tail besides a round of packs; with 64-bit
  // offsets ptxas (80 registers) issued the bf16 argmax round as 6 loads, then 2 after the first
  // compares, so each row waited two memory latencies (ncu source view, H100, 16384x4095).
  const auto launch = [&](auto offsets) {
    using Idx = decltype(offsets);
    return launch_row_kernel<row_block_kernel<Op, T, P, V, false, kPeel, Idx>,
                             row_block_kernel<Op, T, P, V, kRing, kPeel, Idx>>(
        ring, grid_for(p.outer * p.splits), threads, stream, x, y, partials, p.outer, n, p.splits, chunk);
  };
  cudaError_t err;
  if constexpr (kPeel) err = n < kNarrowRow ? launch(int{}) : launch(int64_t{});
  else err = launch(int64_t{});
  if (err != cudaSuccess || !split) return err;
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
