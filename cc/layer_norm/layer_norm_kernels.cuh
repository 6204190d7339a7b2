// Device code of layer_norm / rms_norm shared by the forward (layer_norm_fwd_kernels.cuh) and the
// backward (layer_norm_bwd_kernels.cuh) kernels.
//
// Three ways to hold a row, chosen on the host by row length (like OneFlow's softmax):
//  - team: a group of kWidth <= 32 lanes of one warp owns a row of up to 1024 elements in
//    registers (kPacks 16-byte packs per lane, interleaved so each access is coalesced);
//    statistics and backward sums are lane shuffles only;
//  - block: one block per row, the row cached in dynamic shared memory, so x is read from
//    global memory once (forward) / x and dy once (backward);
//  - uncached: rows beyond shared memory are re-read from global memory (forward: one pass for
//    the statistics, one pass to write y).
// Variance is never E[x^2] - E[x]^2 of x itself, so data with mean 1e4 and std 0.1 is exact: the
// team kernels sum the squares around the mean (two passes over registers); the block and
// uncached forwards (session 37) take E[d^2] - E[d]^2 of d = x - (the row's first element) in one
// pass where that cannot cancel more than a factor 4, else two passes (shifted_variance).
//
// Backward parameter gradients: a block owns whole "slots" (contiguous rows of one group) and
// sums dy * xhat (and dy) over a slot per column in a fixed order, writing one partial row per
// slot to the workspace; reduce_slots adds a group's slots in a fixed order. Bit-reproducible
// for a given shape and device; no atomics. Full-warp rows of >= 16 columns per lane
// (backward_warp) keep those sums in per-warp shared-memory slices rather than registers.
#pragma once
#include <type_traits>

#include <cooperative_groups.h>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "layer_norm/layer_norm_params.h"

namespace jaxops::layer_norm {

using cuda::acc_t;
using cuda::from_acc;
using cuda::load_pack;
using cuda::Pack;
using cuda::store_pack;
using cuda::to_acc;

template <class T>
constexpr int kVecPack = 16 / static_cast<int>(sizeof(T));

template <class A>
__device__ __forceinline__ A inv_sqrt(A v) {
  return A(1) / sqrt(v);
}

// layer_norm's variance in one pass (session 37): E[d^2] - E[d]^2 for d = x - shift (the row's
// first element; rms_norm: shift = mean_rel = 0), from the row means of d and d^2. Trusted when
// E[d]^2 <= 3/4 E[d^2] (the shift within sqrt(3) standard deviations of the mean): var is then at
// least E[d^2] / 4, so the cancellation multiplies the sums' relative error by at most 4. False
// otherwise (the caller sums the squares around the mean in another pass); NaN / inf rows pass
// and give NaN, as the two-pass formula does.
template <class A>
__device__ __forceinline__ bool shifted_variance(A mean_rel, A mean_sq, A* var) {
  *var = mean_sq - mean_rel * mean_rel;
  return !(mean_rel * mean_rel > A(0.75) * mean_sq);
}

// Sum over each group of kWidth consecutive lanes; every lane of the warp must call it.
template <int kWidth, class A>
__device__ __forceinline__ A team_sum(A v) {
  return cuda::warp_reduce<cuda::SumOp, kWidth>(v);
}

// Block-wide sums of two values in a fixed order; every thread gets both. scratch: 64 values.
template <class A>
__device__ __forceinline__ void block_sum2(A& a, A& b, A* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  a = cuda::warp_reduce<cuda::SumOp>(a);
  b = cuda::warp_reduce<cuda::SumOp>(b);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
  }
  __syncthreads();
  a = A(0);
  b = A(0);
  for (int w = 0; w < nwarps; ++w) {
    a += scratch[w];
    b += scratch[32 + w];
  }
}

// Hides a value's registers from the optimizer (no code): whatever was computed from them
// before cannot be reused after, so it is recomputed instead of kept live.
template <class P>
__device__ __forceinline__ void opaque_regs(P& v) {
  if constexpr (sizeof(P) % 4 == 0) {  // (single 16-bit elements, the scalar fallback, are left alone)
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(P) / 4); ++i) asm volatile("" : "+r"(w[i]));
  }
}

// opaque_regs over every pack a thread holds of a row (opaque_packs) or of a team's rows
// (opaque_rows): the 16-bit kernels convert x (and dy) again in each pass instead of keeping the
// converted floats live across the reductions.
template <class P, int kPacks>
__device__ __forceinline__ void opaque_packs(P (&packs)[kPacks]) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) opaque_regs(packs[k]);
}

template <class P, int kRows, int kPacks>
__device__ __forceinline__ void opaque_rows(P (&xp)[kRows][kPacks]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) opaque_packs(xp[r]);
}

}  // namespace jaxops::layer_norm
