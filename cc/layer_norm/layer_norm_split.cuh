// Register rows split over the blocks of a thread-block cluster (session 32), for rows longer
// than one block's registers hold (16-bit and float rows past 8192 columns). Before this, those
// rows took backward_block, which keeps a whole row in one block's shared memory (one block an
// SM, strictly load -> reduce -> write) or, past shared memory, its column sums in the global
// workspace: H100, bf16 layer_norm_bwd 4096x12288 312 us (0.32 of its bound), 2048x32768 1691 us
// (0.08, a quarter of XLA's speed).
//
// Block r of a cluster of n owns packs [r * per, (r + 1) * per) of every row, with per =
// ceil(packs / n), and runs the register-row kernel on them unchanged. The two row sums are
// added across the cluster through distributed shared memory in a fixed order, so every block
// gets the same bits; the column sums stay per block (each owns its columns) and go to the slot's
// partial row at the block's offset. Clusters, not blocks, own slots.
#pragma once
#include <cooperative_groups.h>

#include "layer_norm/layer_norm_kernels.cuh"

namespace jaxops::layer_norm {

// A block's share of a row and of the slots.
struct RowPart {
  int first = 0;  // first pack of the row this block owns
  int count = 0;  // packs it owns (the last block may own fewer, or none)
  int64_t slot0 = 0;
  int64_t slot_step = 1;
};

template <bool kSplit>
__device__ __forceinline__ RowPart row_part(int packs) {
  RowPart p;
  p.count = packs;
  p.slot0 = blockIdx.x;
  p.slot_step = gridDim.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kSplit) {
    unsigned n, rank;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int per = (packs + static_cast<int>(n) - 1) / static_cast<int>(n);
    p.first = min(static_cast<int>(rank) * per, packs);
    p.count = min(per, packs - p.first);
    p.slot0 = blockIdx.x / n;
    p.slot_step = gridDim.x / n;
  }
#endif
  return p;
}

// Row sums of a split row: every warp's (a, b) across the whole cluster, with one cluster
// barrier and no block barrier (block_sum2 has two, and a cluster sum after it a third). Each
// warp writes its partial to `parts`, two rows of 32 a block used by alternate rows (`parity`):
// a block rewrites a row of them only after the next row's cluster barrier, which every reader
// of their previous values has reached after reading them. After the barrier every warp reads
// all n * warps partials (rank, then warp; lane l takes l, l + 32, ...) and adds them with the
// same lane tree, so every thread of every block gets the same bits.
template <bool kSplit, class A>
__device__ __forceinline__ void split_row_sums(A& a, A& b, float2 (*parts)[32], int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kSplit) {
    static_assert(sizeof(A) == 4, "float sums");
    auto cluster = cooperative_groups::this_cluster();
    const int lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
    a = cuda::warp_reduce<cuda::SumOp>(a);
    b = cuda::warp_reduce<cuda::SumOp>(b);
    if (lane == 0) parts[parity][threadIdx.x / 32] = make_float2(a, b);
    cluster.sync();
    unsigned n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    float sa = 0.0f, sb = 0.0f;
    for (int q = lane; q < static_cast<int>(n) * warps; q += 32) {
      const float2 v = cluster.map_shared_rank(parts[parity], q / warps)[q % warps];
      sa += v.x;
      sb += v.y;
    }
    a = cuda::warp_reduce<cuda::SumOp>(sa);
    b = cuda::warp_reduce<cuda::SumOp>(sb);
  }
#endif
}

// A block leaves only when no peer can still read its `parts`.
template <bool kSplit>
__device__ __forceinline__ void leave_cluster() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kSplit) cooperative_groups::this_cluster().sync();
#endif
}

}  // namespace jaxops::layer_norm
