// Backward launchers: dx and per-slot partial column sums (team / block-cached / uncached
// kernel by row length), then reduce_slots for dscale (and dbias).
#include <cstdlib>

#include "layer_norm/layer_norm_cuda.h"
#include "layer_norm/layer_norm_bwd_kernels.cuh"
#include "layer_norm/layer_norm_launch.cuh"
#include "layer_norm/layer_norm_lean_bwd.cuh"

namespace jaxops::layer_norm {
namespace {

constexpr int kTeamThreads = 256;

// backward_warp's __launch_bounds__ minimum blocks per SM (256 threads each), i.e. a register
// cap of 80 (3 blocks) or 128 (2). x and dy of a row take 2 * elems * sizeof(T) / 4 registers
// per lane, and a pack's accumulators (2 * kPack) are live while it is updated. ptxas -v, sm_90:
// 16 elements per lane (float 512 columns, 16-bit 256 columns) fit 80 registers without spills;
// 32 (float 1024 columns) need 113-125. (16-bit rows of 32 elements a lane, 1024 columns, take
// backward_rows_lean since session 6.)
template <class T>
constexpr int warp_min_blocks(int elems) {
  if (sizeof(T) == 8) return 1;  // double (no target) spilled at 128 on sm_90; it takes ~142
  const int data_regs = 2 * elems * static_cast<int>(sizeof(T)) / 4;
  return data_regs <= 32 && elems <= 16 ? 3 : 2;
}

// Slots per group and grid: enough blocks to fill the device (blocks_per_sm per SM), at most
// the workspace's slots and one slot per row.
struct SlotPlan {
  int64_t used = 1;
  int64_t grid = 1;
};

SlotPlan plan_slots(const BackwardArgs& a, const cuda::DeviceInfo& info, int blocks_per_sm) {
  const Shape& s = a.shape;
  const int64_t target = int64_t{info.sm_count} * blocks_per_sm;
  SlotPlan p;
  p.used = std::clamp<int64_t>((target + s.groups - 1) / s.groups, 1,
                               std::min(a.slots_per_group, s.rows_per_group));
  p.grid = std::min(s.groups * p.used, target);
  return p;
}

template <class T>
cudaError_t launch_reduce(const BackwardArgs& a, int64_t used, cudaStream_t stream) {
  const int64_t blocks = (a.shape.cols + 31) / 32 * a.shape.groups * num_acc(a.shape.rms);
  return cuda::launch_kernel(reduce_slots<T>, static_cast<unsigned>(blocks), dim3(32, kSlotLanes), 0, stream, a, used);
}

// Blocks per cluster of a kernel that adds its column sums across a cluster (store_cluster_sums):
// `preferred` on Hopper with one group, else 1 (plain slots). JAXOPS_LN_CLUSTER=N (a test hook,
// read at every launch) overrides `preferred` with 1, 2, 4 or 8.
int slot_cluster(const BackwardArgs& a, const cuda::DeviceInfo& info, int preferred) {
  if (info.cc_major < 9 || a.shape.groups != 1) return 1;
  if (const char* e = std::getenv("JAXOPS_LN_CLUSTER"); e != nullptr && e[0] != '\0') preferred = std::atoi(e);
  return preferred == 2 || preferred == 4 || preferred == 8 ? preferred : 1;
}

// One slot per block in clusters of n: as many whole clusters as are resident at once, within
// the workspace's slots and the rows; reduce_slots then adds one partial row per cluster. False
// when the plain plan applies (n == 1, or fewer rows or slots than one cluster).
template <class T, class Kernel>
bool launch_cluster_slots(Kernel kernel, const BackwardArgs& a, const cuda::DeviceInfo& info, int threads,
                          size_t smem, int preferred, cudaStream_t stream, cudaError_t* status) {
  const int n = slot_cluster(a, info, preferred);
  if (n == 1) return false;
  const int64_t clusters = std::min(cuda::resident_clusters(kernel, threads, smem, n, info),
                                    std::min(a.slots_per_group, a.shape.rows_per_group) / n);
  if (clusters < 1) return false;
  const int64_t used = clusters * n;
  *status = cuda::launch_clustered(kernel, used, threads, smem, n, stream, a, used);
  if (*status == cudaSuccess) *status = launch_reduce<T>(a, clusters, stream);
  return true;
}

// `cluster` > 0: the kernel calls store_cluster_sums and prefers clusters of that many blocks.
template <class T, class Kernel>
cudaError_t launch_slotted(Kernel kernel, const BackwardArgs& a, const cuda::DeviceInfo& info, int threads,
                           size_t smem, cudaStream_t stream, int cluster = 0) {
  if (cudaError_t status;
      cluster > 0 && launch_cluster_slots<T>(kernel, a, info, threads, smem, cluster, stream, &status))
    return status;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, threads, smem, &per_sm); err != cudaSuccess) return err;
  const SlotPlan plan = plan_slots(a, info, per_sm);
  if (cudaError_t err = cuda::launch_kernel(kernel, static_cast<unsigned>(plan.grid), threads, smem, stream, a,
      plan.used); err != cudaSuccess) return err;
  return launch_reduce<T>(a, plan.used, stream);
}

template <class T, int kPack, int kPacks, int kWidth>
cudaError_t launch_team(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const size_t smem = sizeof(acc_t<T>) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
  return launch_slotted<T>(backward_team<T, kPack, kPacks, kWidth>, a, info, kTeamThreads, smem, stream);
}

template <class T, int kPack>
cudaError_t launch_narrow(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                          int width) {
  switch (width) {
    case 1: return launch_team<T, kPack, 1, 1>(a, info, stream);
    case 2: return launch_team<T, kPack, 1, 2>(a, info, stream);
    case 4: return launch_team<T, kPack, 1, 4>(a, info, stream);
    case 8: return launch_team<T, kPack, 1, 8>(a, info, stream);
    case 16: return launch_team<T, kPack, 1, 16>(a, info, stream);
    default: return launch_team<T, kPack, 1, 32>(a, info, stream);
  }
}

// Full-warp rows with >= 16 columns per lane: accumulators in shared memory (backward_warp).
template <class T, int kPack, int kPacks>
cudaError_t launch_warp(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  constexpr int kMinBlocks = warp_min_blocks<T>(kPack * kPacks);
  const size_t smem = warp_acc_smem<acc_t<T>, kPack, kPacks>(kTeamThreads, num_acc(a.shape.rms));
  return launch_slotted<T>(backward_warp<T, kPack, kPacks, kMinBlocks>, a, info, kTeamThreads, smem, stream);
}

// Team (register accumulators) or warp (shared-memory accumulators) kernel for kPacks per lane.
template <class T, int kPack, int kPacks>
cudaError_t launch_full_warp(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  if constexpr (warp_acc_in_smem(kPack, kPacks)) return launch_warp<T, kPack, kPacks>(a, info, stream);
  else return launch_team<T, kPack, kPacks, 32>(a, info, stream);
}

// 16-bit rows of 8-element packs with more than 64 packs take backward_rows_lean (session 6).
template <class T, int kPack>
constexpr bool kLeanRows = sizeof(T) == 2 && kPack == 8;

template <class T, int kPack>
cudaError_t launch_wide(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream, int packs) {
  if constexpr (kPack > 1) {
    if (packs <= 2) return launch_full_warp<T, kPack, 2>(a, info, stream);
    if constexpr (!kLeanRows<T, kPack>) {  // (16-bit: backward_packed sent > 64 packs elsewhere)
      if (packs <= 4 && 4 * kPack <= 32) return launch_full_warp<T, kPack, 4>(a, info, stream);
      if constexpr (8 * kPack <= 32) return launch_full_warp<T, kPack, 8>(a, info, stream);
    }
  }
  return cudaErrorInvalidValue;  // unreachable: the caller checked the capacity
}

template <class T, int kPack>
cudaError_t backward_packed(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  using A = acc_t<T>;
  const int64_t npacks = a.shape.cols / kPack;
  constexpr int64_t kMaxTeamPacks = kPack > 1 ? 32 * std::min(8, 32 / kPack) : 32;
  if (npacks <= 32) return launch_narrow<T, kPack>(a, info, stream, team_width(npacks));
  if constexpr (kLeanRows<T, kPack>) {
    // 16-bit rows of 65-128 packs (520-1024 columns): the lean row kernel with one pack a thread
    // and the next row prefetched (96-128 threads a row, <= 64 registers, 8 blocks an SM) instead
    // of backward_warp (128 registers, 2 blocks of 8 row-warps, session-4 math: IEEE divisions,
    // per-row scale loads). H100, session 6: bf16 65536x1024 layer_norm_bwd 163.4 -> 151.6 us.
    // No clusters by default: session 8 measured 2 / 4 blocks a cluster within +-2 % (layer_norm
    // slower, rms_norm faster, in two runs).
    if (npacks > 64 && npacks <= 128) {
      const int threads = static_cast<int>((npacks + 31) / 32 * 32);
      const size_t acc_smem = sizeof(float) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
      return launch_slotted<T>(backward_rows_lean<T, kPack, 1, true>, a, info, threads, acc_smem, stream, 1);
    }
  }
  if (npacks <= kMaxTeamPacks) return launch_wide<T, kPack>(a, info, stream, team_packs(npacks));

  if constexpr (kPack > 1 && sizeof(T) < 8) {
    // Register rows (x and dy in registers): 16-bit types 2 packs a thread (backward_rows_lean,
    // session 5, <= 64 registers), float 4 (backward_rows); at most 512 threads: up to 8192
    // columns. Both keep the column accumulators in shared memory: nacc x cols floats.
    constexpr int kRowPacks = sizeof(T) == 2 ? 2 : 4;
    if (npacks <= int64_t{512} * kRowPacks) {
      const int threads = static_cast<int>(std::max<int64_t>((npacks + kRowPacks - 1) / kRowPacks + 31, 64) / 32 * 32);
      const size_t smem = sizeof(A) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
      if constexpr (sizeof(T) == 2) {
        // <= 4096 columns: next row prefetched, 3 blocks of 256 an SM (session 6: bf16 16384x4096
        // layer_norm_bwd 165.5 -> 158.9 us); 8192 columns: session 5's kernel, 2 blocks of 512.
        // Column sums added over clusters of 4 / 2 blocks (session 8, H100, two runs: bf16
        // layer_norm_bwd 16384x4096 160.0 -> 152.2 us, 8192x8192 160.1 -> 155.1; rms_norm_bwd
        // within +-1 %). reduce_slots itself gains only 1-1.5 us; the rest is the row kernel's,
        // whose time moved with the cluster size by up to +-3 %, reproducibly but differently for
        // the two ops (the block-to-SM placement changes with clusters): the sizes are the
        // measured best for layer_norm that do not slow rms_norm.
        if (npacks <= 256 * kRowPacks)
          return launch_slotted<T>(backward_rows_lean<T, kPack, kRowPacks, true>, a, info, threads, smem, stream,
                                    4);
        return launch_slotted<T>(backward_rows_lean<T, kPack, kRowPacks>, a, info, threads, smem, stream, 2);
      } else {
        // float: clusters of 2 measured 0-2.5 us faster at 4096 / 8192 columns (session 8).
        return launch_slotted<T>(backward_rows<T, kPack, kRowPacks>, a, info, threads, smem, stream, 2);
      }
    }
  }
  const int threads = block_threads(npacks, 2);
  const size_t cached = (sizeof(A) * num_acc(a.shape.rms) + 2 * sizeof(T)) * static_cast<size_t>(a.shape.cols);
  if (cached <= dynamic_smem_limit(info, 64 * sizeof(A)))
    return launch_slotted<T>(backward_block<T, kPack, true>, a, info, threads, cached, stream);
  return launch_slotted<T>(backward_block<T, kPack, false>, a, info, threads, 0, stream);
}

template <class T>
cudaError_t backward_typed(const BackwardArgs& a, cudaStream_t stream) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return err;
  const void* ptrs[] = {a.x, a.dy, a.dx, a.scale};
  if (cuda::pack_size_for<T>(a.shape.cols, ptrs, 4) == kVecPack<T>)
    return backward_packed<T, kVecPack<T>>(a, info, stream);
  return backward_packed<T, 1>(a, info, stream);
}

}  // namespace

cudaError_t backward_cuda(const BackwardArgs& a, cudaStream_t stream) {
  JAXOPS_DISPATCH_FLOAT(a.dtype, T, return backward_typed<T>(a, stream));
  return cudaErrorInvalidValue;
}

}  // namespace jaxops::layer_norm
