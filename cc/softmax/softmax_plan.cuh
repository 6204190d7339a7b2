// Softmax cached-path plans (host): the cluster, slice and block size of each cached kernel for
// a row length, remembered per kernel and device, and the grids the launchers use.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/cuda_util.cuh"
#include "common/device_info.h"
#include "common/launch.cuh"
#include "common/memo.h"
#include "softmax/softmax_common.cuh"

namespace jaxops::softmax {

struct CachedPlan {
  int64_t max_clusters = 0;  // clusters resident at once: the persistent grid
  int cluster = 1;
  int64_t slice = 0;  // columns per block, a multiple of the pack
  int threads = 0;
  size_t smem = 0;
  // The persistent grid (rather than one block per row; see async_cached_grid): a cluster, or a
  // slice past cached_bytes_per_block.
  bool persistent = false;
};

// Block sizes the cached kernels may use, largest first. A block's phases (load, reduce, exp,
// write) serialize behind block and cluster barriers; only other rows' blocks on the same SM
// keep DRAM busy meanwhile, so the plan takes the block size that fits the most blocks (rows)
// per SM, the larger block on a tie. A thread handles at most kMaxPacksPerThread packs (four
// batches of kUnroll loads) so a row's load phase stays a few round trips long.
constexpr int kCachedThreads[] = {1024, 512, 256, 128};
constexpr int64_t kMaxPacksPerThread = 4 * kUnroll;

// Rows of 32-64 KB (what a block caches) on chips whose DRAM does not outrun the SMs
// (cuda::dram_outruns_sms) take one 64 KB block a row instead of a cluster of two 32 KB blocks:
// the forward one block a row (async_cached_grid), the backward the register-staged kernel. H100,
// session 62 run 3, same-run A/B, 32 KB / 64 KB slices a block, µs: float32 4096x16384 forward
// 196.2 / 179.8, log_softmax 196.0 / 180.1; bf16 2048x32768 forward 102.3 / 91.5, log_softmax
// 101.8 / 91.7; bf16 4096x16384 backward 142.6 / 137.6. Longer rows lost with 64 KB slices there
// (bf16 256x262144 forward 98.5 / 101.0, 2048x32768 backward 142.2 / 143.8; float32 4096x16384
// backward 278.0 / 280.7) and keep 32 KB; the H200 keeps 32 KB throughout (session 36, below).
// Chips without clusters (before sm_90) keep 32 KB: they have no cluster to save, and nothing
// was measured there. Rows of <= 32 KB get the same plan from either budget, so only the rows the
// rule decides read the predicate (a getenv: the JAXOPS_FAST_DRAM hook).
constexpr size_t kOneBlockRowBytes = 64 * 1024;
inline size_t cached_bytes_per_block(size_t row_bytes, const DeviceInfo& dev) {
  const bool one_block = dev.cc_major >= 9 && row_bytes > kCachedBytesPerBlock && row_bytes <= kOneBlockRowBytes &&
                         !dram_outruns_sms(dev);
  return one_block ? kOneBlockRowBytes : kCachedBytesPerBlock;
}

// Picks the smallest cluster whose blocks each cache at most `block_bytes` of the row
// (cached_bytes_per_block; more if the cluster limit is reached); false when even the largest
// cluster cannot cache it.
// The cp.async forward's rows took 64 KB slices from session 8 (H100: f32 512x131072 201.3 ->
// 196.2 µs, 2048x32768 196.8 -> 194.3, bf16 2048x32768 104.4 -> 100.1 against 32 KB) to session
// 36, when the H200 measured 32 KB (twice the cluster, up to twice the blocks an SM) faster or
// equal, and the H100 figures predate the pair-statistics kernel that clusters of >= 4 now take.
// H200, session 36 runs 2-3, µs 64 / 32 KB: f32 2048x32768 144.2 / 140.2 (second device 158.3 /
// 152.9-154.0), 512x131072 146.9 / 144.6, 256x262144 152.7 / 151.3, 4096x16384 156.1 / 156.9-157.3
// (the one loss), 5461x12288 157.4 / 156.1; bf16 512x131072 76.4 / 74.1, 256x262144 79.7 /
// 77.6-77.8, 2048x32768 75.4 / 74.6. 16 KB lost at 12288 (f32 166.1) and bf16 131072 (83.6).
template <class Kernel>
bool plan_cached(Kernel kernel, int64_t cols, int pack, size_t bytes_per_col, size_t block_bytes,
                 const DeviceInfo& dev, CachedPlan* plan) {
  const int max_cluster = dev.cc_major >= 9 ? 16 : 1;
  const size_t smem_limit = static_cast<size_t>(dev.max_smem_optin) - 1024;  // static scratch
  const size_t row_bytes = static_cast<size_t>(cols) * bytes_per_col;
  int cluster = 1;
  while (cluster < max_cluster && row_bytes > block_bytes * cluster) cluster *= 2;
  for (; cluster >= 1; cluster /= 2) {
    const int64_t slice = ceil_div<int64_t>(ceil_div<int64_t>(cols, cluster), pack) * pack;
    const size_t smem = static_cast<size_t>(slice) * bytes_per_col;
    if (smem > smem_limit) return false;
    const int64_t packs = slice / pack;
    const bool persistent = cluster > 1 || smem > block_bytes;
    CachedPlan best;
    for (const int threads : kCachedThreads) {
      if (threads != kCachedThreads[0] && packs > threads * kMaxPacksPerThread) break;
      const int64_t resident = resident_clusters(kernel, threads, smem, cluster, dev);
      if (resident > best.max_clusters) best = {resident, cluster, slice, threads, smem, persistent};
    }
    if (best.max_clusters > 0) {
      *plan = best;
      return true;
    }
  }
  return false;
}

// plan_cached, remembered per (kernel, device, row shape, and the block budget, which the
// JAXOPS_FAST_DRAM test hook may flip within a process). A failure sends the row to the uncached
// path, whose rows are so long that the queries' cost does not show.
template <class Kernel>
bool remembered_plan(Kernel kernel, int64_t cols, int pack, size_t bytes_per_col, const DeviceInfo& dev,
                     CachedPlan* plan) {
  const size_t block_bytes = cached_bytes_per_block(static_cast<size_t>(cols) * bytes_per_col, dev);
  const int64_t key = int64_t(bytes_per_col) * 2 + (block_bytes == kCachedBytesPerBlock ? 0 : 1);
  return remembered(reinterpret_cast<const void*>(kernel), dev.device, cols, key, plan,
                    [&](CachedPlan* p) {
                      return plan_cached(kernel, cols, pack, bytes_per_col, block_bytes, dev, p);
                    });
}

// A persistent grid: every resident cluster loops over rows, so cluster scheduling is paid once
// and each block requests its next row while writing the current one (forward, 16-byte packs).
// Long rows (a cluster, or more than one block's cache budget) need that refill: one cluster per
// row measured 3-7 % slower at 128K-256K columns (session 5).
inline int64_t cached_grid(int64_t rows, const CachedPlan& plan) {
  return std::min<int64_t>(rows, plan.max_clusters) * plan.cluster;
}

// The cp.async forward's grid. Rows within one block's cache budget get one block per row
// (the row loop runs once, so nothing is prefetched): the hardware refills each SM's block slots
// as rows finish, which measured 5-10 % faster than the persistent grid with refill at
// 1025-8192 columns (session 5; the persistent grid's blocks finish their last rows unevenly,
// and each block's row loop serializes its rows' latencies).
inline int64_t async_cached_grid(int64_t rows, const CachedPlan& plan) {
  if (!plan.persistent) return std::min<int64_t>(rows, INT32_MAX);
  return cached_grid(rows, plan);
}

// L2 the lean backward may fill with its blocks' next rows (see l2_prefetch_bytes): half of each
// block's next slice at float32 256x262144. H200, session 36 runs 2-3, same-run sweeps, softmax /
// log_softmax backward µs: 16 MB (the whole next slice, session 6's H100 choice) 251.8 / 252.2,
// 8 MB 243.6 / 244.1 (a second device: 249.9 -> 240.9; 4 MB 246.2, 6 MB 244.3, 12 MB 244.6, none
// 267.7). Prefetching two rows ahead (16 MB: half of each of the next two slices) measured 251.6,
// 24-32 MB two ahead 270-284: the prefetched lines and the output stream then outgrow L2. The rest of
// each slice comes by cp.async straight from DRAM as before.
constexpr size_t kL2PrefetchBudget = size_t(8) << 20;

// Bytes of each input array's next slice a block of the lean backward prefetches into L2 while it
// reduces its current row; 0 (no prefetch) unless the plan's resident grid has at most one block
// per SM (plan.max_clusters * plan.cluster <= SMs; Hopper only: 16-block clusters whose blocks
// cache over ~113 KB, i.e. float32 rows of ~232K-462K columns and 16-bit rows of ~464K-925K;
// measured: float32 256x262144 only). There every block of the grid reduces in step with nothing
// else on its SM, and DRAM idles unless L2 fetches the next row meanwhile (session 6, H100: 323
// -> 303 us, 1.44x XLA). Where several blocks share an SM, other rows' blocks keep
// DRAM busy and the prefetch only added traffic: 15-25 % slower (forward and backward, every
// dtype). The budget, shared by every resident block, bounds what waits in L2 (50 MB on H100)
// next to the output stream, so prefetched lines are not evicted before the refill reads them.
inline unsigned l2_prefetch_bytes(const CachedPlan& plan, const DeviceInfo& dev, int arrays, size_t elem_bytes) {
  const int64_t blocks = plan.max_clusters * plan.cluster;
  if (dev.cc_major < 9 || !plan.persistent || blocks <= 0 || blocks > dev.sm_count) return 0;
  const size_t slice_bytes = size_t(plan.slice) * elem_bytes;
  const size_t share = kL2PrefetchBudget / size_t(blocks) / arrays / 16 * 16;
  return unsigned(std::min(share, slice_bytes));
}

// The tiled kernels' grid (softmax_tiled.cuh): as many blocks as the device holds at once, at
// most one a tile of `tile_rows` rows; each block loops over its tiles. 0 when none fits.
template <class Kernel>
int64_t tiled_grid(Kernel kernel, int64_t rows, int tile_rows, int threads, size_t smem, const DeviceInfo& dev) {
  const int64_t resident = remembered_resident_clusters(kernel, threads, smem, 1, dev);
  return std::min<int64_t>(ceil_div<int64_t>(rows, tile_rows), resident);
}

inline int64_t uncached_grid(int64_t rows, const DeviceInfo& dev) {
  return std::min<int64_t>(rows, int64_t(dev.sm_count) * 2);
}

}  // namespace jaxops::softmax
