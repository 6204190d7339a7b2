// Thread-block-cluster helpers (Hopper distributed shared memory) that degrade to a single
// block on older architectures or when a kernel is launched without a cluster.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "common/cuda_util.cuh"

namespace jaxops::cuda {

__device__ __forceinline__ unsigned cluster_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().num_blocks();
#else
  return 1;
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  return 0;
#endif
}

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// Combines one value per block across the cluster. Every block computes the same fixed-order
// tree over the same inputs, so all blocks get bit-identical results. `slot` and `bcast` are
// __shared__ words private to this call site; a slot may be rewritten only after the next
// cluster_sync following this call (callers alternate slots).
template <class Op, class A>
__device__ __forceinline__ A cluster_allreduce(A block_value, A* slot, A* bcast, Op op = Op{}) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  auto cluster = cooperative_groups::this_cluster();
  const unsigned n = cluster.num_blocks();
  if (n == 1) return block_value;
  if (threadIdx.x == 0) *slot = block_value;
  cluster.sync();
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    A v = lane < n ? *cluster.map_shared_rank(slot, lane) : Op::template identity<A>();
    v = warp_reduce<Op>(v, op);
    if (lane == 0) *bcast = v;
  }
  __syncthreads();
  return *bcast;
#else
  return block_value;
#endif
}

}  // namespace jaxops::cuda
