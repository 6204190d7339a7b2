// Backward launchers: dx and per-slot partial column sums (team / block-cached / uncached
// kernel by row length), then reduce_slots for dscale (and dbias).
#include <cstdlib>
#include <type_traits>

#include "layer_norm/layer_norm_cuda.h"
#include "layer_norm/layer_norm_bwd_kernels.cuh"
#include "layer_norm/layer_norm_skew_bwd.cuh"
#include "layer_norm/layer_norm_launch.cuh"
#include "layer_norm/layer_norm_lean_bwd.cuh"
#include "layer_norm/layer_norm_long_bwd.cuh"
#include "layer_norm/layer_norm_pair_bwd.cuh"
#include "layer_norm/layer_norm_split.cuh"
#include "layer_norm/layer_norm_team_bwd.cuh"
#include "layer_norm/layer_norm_warp_bwd.cuh"

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

// Slots per group: the groups' slots together fill at most `resident` blocks (or clusters), so
// that no block runs a second slot while others idle. Rounding up, as before session 41, gave 8
// groups (vmap) 17 slots each for 132 blocks: 4 blocks ran two slots, and the f32 backward of
// 8x128x8192 took 59 us instead of about 30.
int64_t slots_per_group(const BackwardArgs& a, int64_t resident) {
  const Shape& s = a.shape;
  return std::clamp<int64_t>(resident / s.groups, 1, std::min(a.slots_per_group, s.rows_per_group));
}

SlotPlan plan_slots(const BackwardArgs& a, const cuda::DeviceInfo& info, int blocks_per_sm) {
  const int64_t target = int64_t{info.sm_count} * blocks_per_sm;
  SlotPlan p;
  p.used = slots_per_group(a, target);
  p.grid = std::min(a.shape.groups * p.used, target);
  return p;
}

template <class T>
cudaError_t launch_reduce(const BackwardArgs& a, int64_t used, cudaStream_t stream) {
  const int64_t outputs = a.shape.cols * a.shape.groups * num_acc(a.shape.rms);
  if (used <= kFewSlots)
    return cuda::launch_kernel(reduce_few_slots<T>, static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream, a,
                               used);
  const int lanes = slot_lanes(used);
  const auto kernel = lanes == kSlotLanes ? reduce_slots<T, kSlotLanes> : reduce_slots<T, 8>;
  const int64_t blocks = (a.shape.cols + 31) / 32 * a.shape.groups * num_acc(a.shape.rms);
  return cuda::launch_kernel(kernel, static_cast<unsigned>(blocks), dim3(32, lanes), 0, stream, a, used);
}

// Blocks per cluster of a kernel that adds its column sums across a cluster (store_cluster_sums):
// `preferred` on Hopper with one group, else 1 (plain slots). JAXOPS_LN_CLUSTER=N (a test hook,
// read at every launch) overrides `preferred` with 1, 2, 4 or 8.
int slot_cluster(const BackwardArgs& a, const cuda::DeviceInfo& info, int preferred) {
  if (info.cc_major < 9 || a.shape.groups != 1) return 1;
  if (const char* e = std::getenv("JAXOPS_LN_CLUSTER"); e != nullptr && e[0] != '\0') preferred = std::atoi(e);
  return preferred == 2 || preferred == 4 || preferred == 8 ? preferred : 1;
}

// One run of rows per block in clusters of n, as many whole clusters as are resident at once, and
// at most a row per block; reduce_slots then adds one partial row per cluster (store_cluster_sums
// adds the blocks' column sums). 16-bit rows: one workspace slot per cluster (session 33; the
// blocks were capped at the slots before, and 528 slots held short rows' blocks of 96-128
// threads to 4 an SM). H100, session 33 run 4, us (before -> after): bf16 layer_norm_bwd
// 32768x1032 112.6 -> 89.5, 16384x1536 72.3 -> 62.8, 16384x2048 86.7 -> 80.8; rms_norm_bwd
// 103.7 -> 84.4, 66.5 -> 60.7, 80.6 -> 78.5. float keeps one slot per block: more blocks
// measured 8 % faster at 1032 columns (171.3 -> 157.6) but 1-4 % slower at 1536-2048 (rms_norm
// 16384x1536 116.7 -> 121.5). False when the plain plan applies (n == 1, or fewer rows or slots
// than one cluster).
template <class T, class Kernel>
bool launch_cluster_slots(Kernel kernel, const BackwardArgs& a, const cuda::DeviceInfo& info, int threads,
                          size_t smem, int preferred, cudaStream_t stream, cudaError_t* status) {
  const int n = slot_cluster(a, info, preferred);
  if (n == 1) return false;
  const int64_t rows = a.shape.rows_per_group, slots = a.slots_per_group;
  const int64_t most = sizeof(T) == 2 ? std::min(slots, rows / n) : std::min(slots, rows) / n;
  const int64_t clusters = std::min(cuda::remembered_resident_clusters(kernel, threads, smem, n, info), most);
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
  if (cudaError_t err = prepare(kernel, threads, smem, info, &per_sm); err != cudaSuccess) return err;
  const SlotPlan plan = plan_slots(a, info, per_sm);
  if (cudaError_t err = cuda::launch_kernel(kernel, static_cast<unsigned>(plan.grid), threads, smem, stream, a,
      plan.used); err != cudaSuccess) return err;
  return launch_reduce<T>(a, plan.used, stream);
}

// Rows split over clusters of n blocks (layer_norm_split.cuh), each block running `kernel` on
// ceil(packs / n) packs of every row, `per_thread` packs a thread. Clusters own the slots: as
// many as are resident at once, within the workspace's slots and the rows. False when no
// cluster of this shape fits (the caller falls back).
template <class T, int kPack, class Kernel>
bool launch_split(Kernel kernel, const BackwardArgs& a, const cuda::DeviceInfo& info, int n, int per_thread,
                  cudaStream_t stream, cudaError_t* status) {
  const Shape& s = a.shape;
  const int64_t per = (s.cols / kPack + n - 1) / n;
  const int threads = register_row_threads(per, per_thread);
  const size_t smem = sizeof(acc_t<T>) * num_acc(s.rms) * static_cast<size_t>(per * kPack);
  const int64_t resident = cuda::remembered_resident_clusters(kernel, threads, smem, n, info);
  if (resident < 1) return false;
  const int64_t used = slots_per_group(a, resident);
  *status = cuda::launch_clustered(kernel, std::min(s.groups * used, resident) * n, threads, smem, n, stream, a, used);
  if (*status == cudaSuccess) *status = launch_reduce<T>(a, used, stream);
  return true;
}

// JAXOPS_LN_SPLIT=n (a test hook, read at every launch): rows of the register-row kernels'
// lengths split over n = 2..8 blocks even where one block holds them. 0 when unset or invalid.
int forced_split() {
  const char* e = std::getenv("JAXOPS_LN_SPLIT");
  const int n = e != nullptr ? std::atoi(e) : 0;
  return n >= 2 && n <= 8 ? n : 0;
}

// JAXOPS_LN_NO_RING=1 (a test hook, read at every launch): 16-bit layer_norm rows past 6144
// columns take the register-prefetch kernel, as where shared memory cannot hold the row ring.
bool ring_disabled() {
  const char* e = std::getenv("JAXOPS_LN_NO_RING");
  return e != nullptr && e[0] == '1';
}

// How many blocks share a row: n = ceil(packs / cap) for a block capacity `cap` (packs) from
// `caps` (ascending), the one whose shares fill their blocks best (fewest idle threads); among
// equal fills the smaller blocks if `small_first`, else the larger. `forced` > 0 fixes n (the
// best-filled capacity that holds its shares). 0 when no capacity holds the shares of a cluster
// of <= 16 blocks (Hopper's largest, non-portable: cuda::allow_cluster opts in past 8).
inline int split_blocks(int64_t npacks, const int (&caps)[3], bool small_first, int forced) {
  int best = 0;
  double best_fill = 0.0;
  for (int i = 0; i < 3; ++i) {
    const int64_t cap = caps[small_first ? i : 2 - i];
    const int64_t n = forced > 0 ? forced : (npacks + cap - 1) / cap;
    if (n > 16 || (npacks + n - 1) / n > cap) continue;
    if (const double fill = static_cast<double>(npacks) / static_cast<double>(n * cap); fill > best_fill * 1.000001) {
      best = static_cast<int>(n);
      best_fill = fill;
    }
  }
  return best;
}

// Register rows past one block (Hopper), split over a cluster of up to 16 blocks. Block
// capacities: 16-bit 256 / 512 packs (the kernel with the next row prefetched, 128 / 256
// threads) or 1024 (the plain one, 512 threads); float 512 / 1024 / 2048 (128 / 256 / 512
// threads). Equal fills: 16-bit rows take the smaller blocks, float rows the larger (H100,
// session 32 run 2, us: bf16 layer_norm_bwd 6144x10240 5 blocks 168.7 / 3 blocks 181.7 /
// 2 185.3, 4096x12288 6 blocks 140.7 / 3 143.5; float 4096x16384 2 blocks 343.4 / 4 364.0 /
// 8 376.0, 6144x10240 5 blocks 338.8 / 2 385.8). `forced` (> 0) fixes the block count. False when
// no split fits (the caller falls back to backward_block).
template <class T, int kPack>
bool backward_split(const BackwardArgs& a, const cuda::DeviceInfo& info, int forced, cudaStream_t stream,
                    cudaError_t* status) {
  if (info.cc_major < 9) return false;
  const int64_t npacks = a.shape.cols / kPack;
  if constexpr (sizeof(T) == 2) {
    const int n = split_blocks(npacks, {256, 512, 1024}, true, forced);
    if (n == 0) return false;
    if ((npacks + n - 1) / n <= 512)
      return launch_split<T, kPack>(backward_rows_lean<T, kPack, 2, true, true>, a, info, n, 2, stream, status);
    return launch_split<T, kPack>(backward_rows_lean<T, kPack, 2, false, true>, a, info, n, 2, stream, status);
  } else {
    const int n = split_blocks(npacks, {512, 1024, 2048}, false, forced);
    if (n == 0) return false;
    return launch_split<T, kPack>(backward_rows<T, kPack, 4, true>, a, info, n, 4, stream, status);
  }
}

// Rows no cached kernel holds, as three kernels (layer_norm_long_bwd.cuh). False (the caller takes
// backward_block uncached) for a workspace too small for the row sums, more groups than a grid's
// y dimension, or unaligned dscale / dbias.
template <class T, int kPack>
bool backward_long_rows(const BackwardArgs& a, cudaStream_t stream, cudaError_t* status) {
  const Shape& s = a.shape;
  if (s.groups > 65535) return false;
  const int64_t npacks = s.cols / kPack;
  const int64_t chunks = (npacks + kLongSumThreads * kLongSumPacks - 1) / (kLongSumThreads * kLongSumPacks);
  const int64_t need = 2 * s.rows * (chunks + 1);
  const int64_t have = s.groups * a.slots_per_group * num_acc(s.rms) * s.cols;
  if (need > have || s.rows * chunks > int64_t{0x7fffffff}) return false;
  for (const void* p : {static_cast<const void*>(a.dscale), static_cast<const void*>(a.dbias)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  auto sums = s.rms ? long_row_sums<T, kPack, true> : long_row_sums<T, kPack, false>;
  auto coefs = s.rms ? long_row_coefs<true> : long_row_coefs<false>;
  auto dx = s.rms ? long_row_dx<T, kPack, true> : long_row_dx<T, kPack, false>;
  *status = cuda::launch_kernel(sums, static_cast<unsigned>(s.rows * chunks), kLongSumThreads, 0, stream, a, chunks);
  if (*status == cudaSuccess)
    *status = cuda::launch_kernel(coefs, static_cast<unsigned>((s.rows * 32 + 255) / 256), 256, 0, stream, a, chunks);
  if (*status == cudaSuccess) {
    const dim3 grid(static_cast<unsigned>((npacks + kLongDxThreads - 1) / kLongDxThreads), static_cast<unsigned>(s.groups));
    *status = cuda::launch_kernel(dx, grid, kLongDxThreads, 0, stream, a, chunks);
  }
  return true;
}

template <class T, int kPack, int kPacks, int kWidth>
cudaError_t launch_team(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const size_t smem = sizeof(acc_t<T>) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
  return launch_slotted<T>(backward_team<T, kPack, kPacks, kWidth>, a, info, kTeamThreads, smem, stream);
}

// Rows of <= 32 16-byte packs (float32, bf16, f16): the lean arithmetic (layer_norm_team_bwd.cuh).
// H200, session 50 run 1, layer_norm_bwd us (backward_team -> backward_team_lean): bf16 524288x128
// 120.8 -> 113.1, 2097152x32 119.9 -> 114.8, 4096x128 9.33 -> 8.82; float32 524288x128 217.3 ->
// 216.4; rms_norm_bwd bf16 524288x128 114.9 -> 107.1.
template <class T, int kPack, int kPacks, int kWidth, int kMinBlocks>
cudaError_t launch_team_lean(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const size_t smem = sizeof(float) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
  auto kernel = a.shape.rms ? backward_team_lean<T, kPack, kPacks, kWidth, true, kMinBlocks>
                            : backward_team_lean<T, kPack, kPacks, kWidth, false, kMinBlocks>;
  return launch_slotted<T>(kernel, a, info, kTeamThreads, smem, stream);
}

// float32 capped for 6 blocks an SM (40 registers, no spill; 45 uncapped: 5 blocks). 16-bit
// uncapped (0): 55-58 registers (4 blocks), rms_norm 40-48 (5); an explicit 4 lets ptxas grow
// rms_norm to 60-63.
template <class T, int kPack, int kWidth>
cudaError_t launch_narrow_lean(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  return launch_team_lean<T, kPack, 1, kWidth, sizeof(T) == 4 ? 6 : 0>(a, info, stream);
}

// Rows that are not whole 16-byte packs (single-element packs, <= 256 columns) take the lean
// arithmetic too, except float32 rms_norm, where it was mixed (1048576x63 238.9 -> 236.1 us,
// 1048576x31 153.6 -> 154.8, 4096x131 8.90 -> 8.14, but 262144x255 311 -> 349).
// H200, session 53 run 1, us (old -> lean): bf16 layer_norm_bwd 508400x132 367 -> 221, 262144x255
// 298 -> 153, 1048576x63 235 -> 173, 1048576x31 186 -> 148; bf16 rms_norm_bwd 508400x132 353 ->
// 327, 1048576x63 206 -> 153, 1048576x31 152 -> 120; float32 layer_norm_bwd 262144x255 316 ->
// 236, 1048576x63 249 -> 236.
// Not one-column rows either: their dx is exactly 0 in backward_team's form (g - mean(g) with
// mean(g) = g), while the lean form leaves the fused multiply-add's rounding residue times
// rstd = 1 / sqrt(epsilon) (session 53 run B: test_one_column_dx_is_exactly_zero).
template <class T, int kPack>
bool scalar_lean(const BackwardArgs& a) {
  if constexpr (kPack == 1 && sizeof(T) <= 4)
    return a.shape.cols > 1 && !(std::is_same_v<T, float> && a.shape.rms);
  else return false;
}

template <class T, int kPack>
cudaError_t launch_narrow(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                          int width) {
  return with_team_width(width, [&](auto w) {
    if constexpr (sizeof(T) <= 4 && kPack * sizeof(T) == 16) {
      // 16-bit rows keep backward_team where DRAM does not outrun the SMs (cuda::dram_outruns_sms).
      // H100, session 63 run 3, us (lean -> team): bf16 rms_norm_bwd 524288x128 150.6 -> 145.3,
      // 2097152x32 155.8 -> 148.2; layer_norm_bwd 150.4 -> 148.3, 155.5 -> 152.2. float32 stays
      // lean there (286.3 -> 287.8); the H200 took lean for both (session 50: bf16 120.8 -> 113.1).
      if constexpr (sizeof(T) == 2)
        if (!cuda::dram_outruns_sms(info)) return launch_team<T, kPack, 1, decltype(w)::value>(a, info, stream);
      return launch_narrow_lean<T, kPack, decltype(w)::value>(a, info, stream);
    } else {  // narrower packs (unaligned rows, float64)
      if constexpr (kPack == 1 && sizeof(T) <= 4)
        if (scalar_lean<T, kPack>(a)) return launch_narrow_lean<T, kPack, decltype(w)::value>(a, info, stream);
      return launch_team<T, kPack, 1, decltype(w)::value>(a, info, stream);
    }
  });
}

// Full-warp rows with >= 16 columns per lane: accumulators in shared memory (backward_warp).
template <class T, int kPack, int kPacks>
cudaError_t launch_warp(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  constexpr int kMinBlocks = warp_min_blocks<T>(kPack * kPacks);
  const size_t smem = warp_acc_smem<acc_t<T>, kPack, kPacks>(kTeamThreads, num_acc(a.shape.rms));
  // 16-byte packs of float / 16-bit types: the lean arithmetic (layer_norm_warp_bwd.cuh). H200,
  // session 53 run 1, us (backward_warp -> backward_warp_lean): bf16 layer_norm_bwd 131072x512
  // 113.0 -> 109.5, 174762x384 135.7 -> 121.7, 254200x264 184.9 -> 158.2; bf16 rms_norm_bwd
  // 109.6 -> 107.2, 129.2 -> 113.5, 174.9 -> 142.9; float32 level (217.0 -> 218.0, 216.7 ->
  // 216.3; rms_norm 213.7 -> 209.9).
  if constexpr (sizeof(T) <= 4 && kPack * sizeof(T) == 16) {
    auto kernel = a.shape.rms ? backward_warp_lean<T, kPack, kPacks, kMinBlocks, true>
                              : backward_warp_lean<T, kPack, kPacks, kMinBlocks, false>;
    return launch_slotted<T>(kernel, a, info, kTeamThreads, smem, stream);
  } else {  // float64, single-element packs
    return launch_slotted<T>(backward_warp<T, kPack, kPacks, kMinBlocks>, a, info, kTeamThreads, smem, stream);
  }
}

// Team (register accumulators) or warp (shared-memory accumulators) kernel for kPacks per lane.
template <class T, int kPack, int kPacks>
cudaError_t launch_full_warp(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  // float32 rows of 33-63 packs (132-252 columns): the lean arithmetic, two packs a lane, capped at
  // 4 blocks (64 / 60 registers, as backward_team's 63). H200, session 50 run 3, layer_norm_bwd us
  // (backward_team -> backward_team_lean): 508400x132 280.6 -> 221.8, 419430x160 261.6 -> 215.0,
  // 349525x192 225.3 -> 212.5, 266305x252 220.7 -> 216.9; rms_norm_bwd alike. Rows of exactly 64
  // packs (256 columns), all lanes full, keep backward_team: 208.5 there against 210.9 (rms_norm
  // 205.0 / 206.2). 16-bit rows of 33-64 packs lost with it (run 2: bf16 131072x512 113.0 ->
  // 125.7 against backward_warp).
  if constexpr (std::is_same_v<T, float> && kPack == 4 && kPacks == 2) {
    if (a.shape.cols < 64 * kPack) return launch_team_lean<T, kPack, 2, 32, 4>(a, info, stream);
  }
  if constexpr (kPack == 1 && sizeof(T) <= 4) {
    // 16-bit rms_norm rows of 129-256 single elements: two rows a warp, 16 lanes of 16. H200,
    // session 59, bf16 rms_norm_bwd us (32 lanes of 8 -> 16 of 16; XLA): 262144x255 285.7 ->
    // 192.6 (235.0), 262144x201 230.5 -> 160.6 (198.0), 508400x131 290.5 -> 233.2 (517.7).
    // layer_norm lost with it (bf16 255 154.3 -> 199.8), float32 rms_norm stayed level.
    if constexpr (sizeof(T) == 2 && kPacks == 8) {
      if (a.shape.rms && scalar_lean<T, kPack>(a)) return launch_team_lean<T, kPack, 16, 16, 0>(a, info, stream);
    }
    if (scalar_lean<T, kPack>(a)) return launch_team_lean<T, kPack, kPacks, 32, 0>(a, info, stream);
  }
  if constexpr (warp_acc_in_smem(kPack, kPacks)) return launch_warp<T, kPack, kPacks>(a, info, stream);
  else return launch_team<T, kPack, kPacks, 32>(a, info, stream);
}

// 16-bit rows of 8-element packs with more than 64 packs take backward_rows_lean (session 6).
template <class T, int kPack>
constexpr bool kLeanRows = sizeof(T) == 2 && kPack == 8;

template <class T, int kPack>
cudaError_t launch_wide(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream, int packs) {
  if constexpr (kPack > 1 || sizeof(T) <= 4) {  // (float64 scalar teams spill)
    if (packs <= 2) return launch_full_warp<T, kPack, 2>(a, info, stream);
    if constexpr (!kLeanRows<T, kPack>) {  // (16-bit: backward_packed sent > 64 packs elsewhere)
      if (packs <= 4 && 4 * kPack <= 32) return launch_full_warp<T, kPack, 4>(a, info, stream);
      if constexpr (8 * kPack <= 32) return launch_full_warp<T, kPack, 8>(a, info, stream);
    }
  }
  return cudaErrorInvalidValue;  // unreachable: the caller checked the capacity
}

// The largest pack (elements per access, up to 16 bytes) that divides `cols` and the alignment of
// x, dy, dx and scale (forward_pack's twin).
template <class T>
int backward_pack(const BackwardArgs& a, int64_t cols) {
  const void* ptrs[] = {a.x, a.dy, a.dx, a.scale};
  return cuda::pack_size_for<T>(cols, ptrs, 4);
}

template <class T, int kPack>
cudaError_t backward_packed(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  using A = acc_t<T>;
  const int64_t npacks = a.shape.cols / kPack;
  // Rows that are not whole 16-byte packs take full-warp teams of 2-8 elements a lane up to 256
  // columns as well (session 51, H200, us, one block a row / team): f32 layer_norm_bwd 1048576x63
  // 1186 / 249, forward 1185 / 361; bf16 layer_norm_bwd 508400x132 771 / 367 (float64 spills).
  constexpr int64_t kMaxTeamPacks = kPack > 1 || sizeof(T) <= 4 ? 32 * std::min(8, 32 / kPack) : 32;
  if (npacks <= 32) return launch_narrow<T, kPack>(a, info, stream, team_width(npacks));
  if constexpr (kLeanRows<T, kPack>) {
    // 16-bit rows of 65-128 packs (520-1024 columns): the lean row kernel with one pack a thread
    // and the next row prefetched (96-128 threads a row, <= 64 registers, 8 blocks an SM) instead
    // of backward_warp (128 registers, 2 blocks of 8 row-warps, session-4 math: IEEE divisions,
    // per-row scale loads). H100, session 6: bf16 65536x1024 layer_norm_bwd 163.4 -> 151.6 us.
    // Clusters of 2 since session 33 (with a slot per cluster, twice the blocks: 8 an SM; before,
    // session 8 measured 2 / 4 within +-2 %). H100, session 33 run 4, bf16 layer_norm_bwd, us:
    // 16384x1024 50.8 -> 45.6, 32768x776 85.3 -> 72.9, 65536x1024 153.9 -> 153.4, 65536x520
    // 104.6 -> 106.0 (clusters of 4: 46.5, 76.1, 156.0, 111.1); rms_norm alike.
    if (npacks > 64 && npacks <= 128) {
      const int threads = register_row_threads(npacks, 1);
      const size_t acc_smem = sizeof(float) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
      return launch_slotted<T>(backward_rows_lean<T, kPack, 1, true>, a, info, threads, acc_smem, stream, 2);
    }
  }
  if (npacks <= kMaxTeamPacks) return launch_wide<T, kPack>(a, info, stream, team_packs(npacks));
  // Rows that are not whole 16-byte packs, 257-512 columns: the scalar lean team with 16 columns
  // a lane (register column sums; 16-bit 114-116 registers, float 121, no spill), float32
  // rms_norm included (unlike scalar_lean's narrower teams). Before, 16-bit rows ran on
  // backward_block<T, 1> (a block a row, one element a load), float32 ones on backward_block_skew
  // (which takes over past 512 columns). H100, us, old -> team / XLA: session 57 run 1, bf16
  // rms_norm_bwd 131072x257 293.7 -> 134.2 / 149.1, 131072x300 309.6 -> 140.5 / 165.7, 65536x509
  // 243.0 -> 110.2 / 144.1; layer_norm_bwd 302.3 -> 139.6 / 580.7, 318.9 -> 145.9 / 415.3, 249.7 ->
  // 114.6 / 395.6; float16 alike. Session 58 run 1, float32 rms_norm_bwd 131072x257 273.7 -> 174.8
  // / 270.1, 87381x383 210.9 -> 155.8 / 260.8, 65536x509 184.1 -> 159.2 / 259.8; layer_norm_bwd
  // 283.0 -> 180.4 / 640.3, 221.7 -> 175.9 / 500.0, 196.0 -> 164.6 / 483.7.
  if constexpr (kPack == 1 && sizeof(T) <= 4) {
    if (npacks <= 16 * 32) return launch_team_lean<T, kPack, 16, 32, 0>(a, info, stream);
  }

  if constexpr (kPack > 1 && sizeof(T) < 8) {
    // Register rows (x and dy in registers): 16-bit types 2 packs a thread (backward_rows_lean,
    // session 5, <= 64 registers), float 4 (backward_rows); at most 512 threads: up to 8192
    // columns; longer rows split over the blocks of a cluster on Hopper (backward_split, up to
    // 131072 columns). Both keep the column accumulators in shared memory: nacc x cols floats.
    constexpr int kRowPacks = sizeof(T) == 2 ? 2 : 4;
    if (const int forced = forced_split(); forced > 0 || npacks > int64_t{512} * kRowPacks) {
      if (cudaError_t status; backward_split<T, kPack>(a, info, forced, stream, &status)) return status;
    }
    if (npacks <= int64_t{512} * kRowPacks) {
      const int threads = register_row_threads(npacks, kRowPacks);
      const size_t smem = sizeof(A) * num_acc(a.shape.rms) * static_cast<size_t>(a.shape.cols);
      if constexpr (sizeof(T) == 2) {
        // <= 4096 columns: next row prefetched, 3 blocks of 256 an SM (session 6: bf16 16384x4096
        // layer_norm_bwd 165.5 -> 158.9 us); 4104-8192 columns: session 5's kernel, 2 blocks of 512
        // (rms_norm, and layer_norm up to 6144 columns; past that see below).
        // Column sums added over clusters of 2 blocks. Session 8 (H100, a slot a block) chose 4 at
        // <= 4096 columns: bf16 layer_norm_bwd 16384x4096 160.0 -> 152.2 us, 8192x8192 160.1 ->
        // 155.1 (rms_norm within +-1 %); the row kernel's time moved with the cluster size by up
        // to +-3 %, differently for the two ops (block-to-SM placement). Session 37 (H200, a slot
        // a cluster since session 33), 4 -> 2 at <= 4096 columns: bf16 layer_norm_bwd 65536x2048
        // 237.3 -> 224.5 us, 32768x4096 248.2 -> 231.7; rms_norm_bwd 207.5 -> 204.0, 209.0 ->
        // 207.5 (1: within 0.5 us of 2 there; 8: slower than 4).
        // Session 40 (H200): two rows an iteration (backward_rows_lean_pair, bit-identical), except
        // for rms_norm rows that fill every thread's two packs, where the prefetch kernel stays
        // ahead. bf16 layer_norm_bwd, us: 65536x2048 224.0 -> 215.6, 32768x4096 231.8 -> 218.6,
        // 65536x3072 337.7 -> 316.2, 65536x1032 142.6 -> 129.1, 65536x2056 265.1 -> 243.6;
        // rms_norm_bwd 65536x1032 125.0 -> 112.0, 65536x1544 173.9 -> 164.0, 65536x2056 237.4 ->
        // 216.5, but 65536x2048 203.9 -> 216.2 and 32768x4096 208.0 -> 218.3 (full rows).
        // Where DRAM does not outrun the SMs (cuda::dram_outruns_sms), layer_norm keeps session 8's
        // plan, the prefetch kernel in clusters of 4: H100, session 61, us, pair in 2 / prefetch in
        // 2 / prefetch in 4: bf16 layer_norm_bwd 32768x2048 158.8 / 155.5 / 147.4, 16384x4096 158.7
        // / 152.6 / 148.8 (prefetch in 4 measured with session 34's tree, which ran this plan).
        // From 2048 columns, as measured: narrower rows keep the pair (H200: 1032 columns -10 %).
        const bool fast_dram = cuda::dram_outruns_sms(info);
        if (npacks >= 256 && npacks <= 256 * kRowPacks && !a.shape.rms && !fast_dram)
          return launch_slotted<T>(backward_rows_lean<T, kPack, kRowPacks, true>, a, info, threads, smem, stream,
                                    4);
        if (npacks <= 256 * kRowPacks && (!a.shape.rms || npacks != int64_t{threads} * kRowPacks))
          return launch_slotted<T>(backward_rows_lean_pair<T, kPack, kRowPacks>, a, info, threads, smem, stream, 2);
        if (npacks <= 256 * kRowPacks)
          return launch_slotted<T>(backward_rows_lean<T, kPack, kRowPacks, true>, a, info, threads, smem, stream,
                                    2);
        // layer_norm past 6144 columns: one pack a thread on up to 1024 threads, the column sums
        // in registers (session 42, H200, bf16 layer_norm_bwd, us, two alternations: 8192x8192
        // 128.5 -> 121.0, 16384x6152 202.0 -> 193.1; but 16384x4104 136.6 -> 152.6 and rms_norm
        // slower at every width: 8192 108.6 -> 111.0, 6152 174.2 -> 181.0, 4104 115.0 -> 144.4).
        // Since session 44 the next 4 rows come by cp.async into a ring behind the column sums
        // (8192 columns: 64 + 128 KB of shared memory; the register prefetch where that does not
        // fit, e.g. 163 KB a block on sm_80): bf16 8192x8192 120.7 -> 116.9 us, 16384x6152 192.4 -> 183.5;
        // since session 45 two rows an iteration (backward_rows_lean_1024_ring): 116.6 -> 114.2,
        // 185.3 -> 174.6.
        // rms_norm through this kernel with the ring: 8192x8192 108.8 -> 112.1-113.4 us (3-4 rows).
        // The ring only where DRAM outruns the SMs: H100, session 61, bf16 8192x8192, us, ring /
        // register prefetch / session 5's kernel: 163.3 / 149.6 / 151.1.
        if (!a.shape.rms && npacks > 768) {
          const int row_threads = register_row_threads(npacks, 1);
          constexpr int kRing = 4;
          const size_t ring = smem + kRing * 2 * sizeof(T) * static_cast<size_t>(a.shape.cols);
          constexpr size_t kStatic = 32 * sizeof(float4);  // the ring kernel's scratch
          if (fast_dram && !ring_disabled() && ring <= dynamic_smem_limit(info, kStatic))
            return launch_slotted<T>(backward_rows_lean_1024_ring<T, kPack, kRing>, a, info, row_threads, ring, stream, 2);
          return launch_slotted<T>(backward_rows_lean_1024<T, kPack>, a, info, row_threads, smem, stream, 2);
        }
        return launch_slotted<T>(backward_rows_lean<T, kPack, kRowPacks>, a, info, threads, smem, stream, 2);
      } else {
        // float: clusters of 2 measured 0-2.5 us faster at 4096 / 8192 columns (session 8).
        // Past 2048 columns the next row's x and dy come by cp.async into shared memory behind the
        // column sums (session 41, H200, us, default / async): layer_norm_bwd 8192x8192 236.5 /
        // 211.7, 16384x4096 221.9 / 215.3, 32768x2048 221.7 / 223.5; rms_norm_bwd 224.8 / 208.2,
        // 215.1 / 212.9, 214.1 / 217.4. At 2048 columns 2 blocks an SM already overlap rows. The
        // 16-bit kernels lost with it (bf16 layer_norm_bwd 8192x8192 128.7 -> 142.9 us). Only where
        // DRAM outruns the SMs: H100, session 61, us, default / async: layer_norm_bwd 8192x8192
        // 285.7 / 298.7, 16384x4096 292.6 / 297.2; rms_norm_bwd 282.0 / 291.1, 291.4 / 293.2.
        if (npacks > 512 && cuda::dram_outruns_sms(info))
          return launch_slotted<T>(backward_rows<T, kPack, kRowPacks, false, true>, a, info, threads,
                                    smem + 2 * sizeof(T) * static_cast<size_t>(a.shape.cols), stream, 2);
        return launch_slotted<T>(backward_rows<T, kPack, kRowPacks>, a, info, threads, smem, stream, 2);
      }
    }
  }
  // Rows that are not whole 16-byte packs past 256 columns, one parameter group, 16-byte aligned
  // pointers: head / packs / tail (backward_block_skew) instead of one element a load, from
  // kSkewBwdMinPacks packs. Session 56, H100, us, backward_block<T, 1> / backward_block_skew / XLA:
  // f32 layer_norm_bwd 131072x257 304.8 / 285.2 / 639.3, 65536x1001 505.6 / 339.9 / 803.6, 16384x4095
  // 471.3 / 389.5 / 732.6; rms_norm_bwd 299.2 / 276.6 / 267.9, 493.5 / 320.0 / 500.8, 467.3 / 352.4 /
  // 473.5; bf16 rms_norm_bwd 65536x1001 493.7 / 287.4 / 274.5, 16384x4095 433.5 / 238.3 / 275.3, but
  // 131072x257 (32 packs) 294.2 / 330.2 / 149.0 (layer_norm_bwd 303.0 / 374.8); rows up to 512
  // columns take the lean team above (16-bit since session 57, float32 since 58). The skewed
  // kernel's column sums changed twice since (layer_norm_skew_bwd.cuh): 311.4 after session 57's
  // race fix, 246.3 with session 58's exact accesses (bf16 rms_norm_bwd 65536x1001).
  if constexpr (kPack == 1 && sizeof(T) <= 4) {
    constexpr int kVec = kVecPack<T>;
    constexpr int64_t kSkewBwdMinPacks = 64;
    const size_t skew_smem = skew_bwd_smem<T, kVec>(a.shape.cols, num_acc(a.shape.rms));
    // (backward_pack over kVec columns: whether the pointers alone are 16-byte aligned)
    if (a.shape.groups == 1 && a.shape.cols / kVec >= kSkewBwdMinPacks && backward_pack<T>(a, kVec) == kVec &&
        skew_smem <= dynamic_smem_limit(info, 64 * sizeof(float)))
      return launch_slotted<T>(backward_block_skew<T, kVec>, a, info, block_threads(a.shape.cols / kVec, 2),
                               skew_smem, stream);
  }
  // Rows no register-row kernel takes: not whole 16-byte packs, float64, longer than a cluster of
  // 16 blocks holds, or before Hopper.
  const int threads = block_threads(npacks, 2);
  const size_t cached = (sizeof(A) * num_acc(a.shape.rms) + 2 * sizeof(T)) * static_cast<size_t>(a.shape.cols);
  if (cached <= dynamic_smem_limit(info, 64 * sizeof(A)))
    return launch_slotted<T>(backward_block<T, kPack, true>, a, info, threads, cached, stream);
  // Longer rows (Hopper: past the 131072 columns of the cluster split): backward_block uncached
  // ran a slot of rows a block and re-read the column sums every row. H200, session 40, three
  // kernels instead, us: f32 layer_norm_bwd 256x262144 1371 -> 324 (0.38 -> 1.61x XLA),
  // 32x2097152 4269 -> 341; bf16 64x1048576 4071 -> 179 (1.92x XLA); rms_norm_bwd f32 64x1048576
  // 1284 -> 325 (1.02x XLA).
  if constexpr (kPack * sizeof(T) == 16 && sizeof(T) <= 4) {
    if (cudaError_t status; backward_long_rows<T, kPack>(a, stream, &status)) return status;
  }
  return launch_slotted<T>(backward_block<T, kPack, false>, a, info, threads, 0, stream);
}

// Rows of 33-64 8-byte packs (16-bit widths of 132-252 columns that are a multiple of 4 but not
// of 8; float32 even widths of 66-126 not a multiple of 4) on the lean team with 8-byte packs
// instead of single elements. H200, session 59, us (single elements -> 8-byte packs; XLA):
// bf16 rms_norm_bwd 508400x132 334.5 -> 161.9 (293.0), 262144x196 244.0 -> 115.5 (191.5),
// 262144x252 285.4 -> 131.0 (210.9); layer_norm_bwd 223.9 -> 179.3 (661.3), 138.3 -> 130.8,
// 153.3 -> 143.8; float32 1048576x66 layer_norm_bwd 308.5 -> 230.2, rms_norm_bwd 356.9 -> 229.6.
// Up to 48 packs 16 lanes of 3, past that 32 lanes of 2 (16 lanes of 3-4 lost there: bf16
// layer_norm_bwd 196 185.6, 252 219.8). float32 rows past 48 packs keep the single elements: 16
// lanes of 4 mixed there (524288x126 rms_norm_bwd 291.4 -> 209.7, layer_norm_bwd 243.1 -> 288.5)
// and 32 lanes of 2 was not measured.
template <class T>
bool half_pack_team(const BackwardArgs& a) {
  constexpr int kHalf = kVecPack<T> / 2;
  const int64_t npacks = a.shape.cols / kHalf;
  if (sizeof(T) > 4 || npacks <= 32 || npacks > (sizeof(T) == 2 ? 64 : 48)) return false;
  return backward_pack<T>(a, a.shape.cols) == kHalf;
}

template <class T>
cudaError_t launch_half_team(const BackwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  if constexpr (sizeof(T) <= 4) {
    constexpr int kHalf = kVecPack<T> / 2;
    if constexpr (sizeof(T) == 2) {  // (float32 stops at 48 packs: half_pack_team)
      if (a.shape.cols / kHalf > 48) return launch_team_lean<T, kHalf, 2, 32, 0>(a, info, stream);
    }
    return launch_team_lean<T, kHalf, 3, 16, 0>(a, info, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: half_pack_team is false past 4-byte types
}

template <class T>
cudaError_t backward_typed(const BackwardArgs& a, cudaStream_t stream) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return err;
  if (half_pack_team<T>(a)) return launch_half_team<T>(a, info, stream);
  if (backward_pack<T>(a, a.shape.cols) == kVecPack<T>)
    return backward_packed<T, kVecPack<T>>(a, info, stream);
  return backward_packed<T, 1>(a, info, stream);
}

}  // namespace

cudaError_t backward_cuda(const BackwardArgs& a, cudaStream_t stream) {
  JAXOPS_DISPATCH_FLOAT(a.dtype, T, return backward_typed<T>(a, stream));
  return cudaErrorInvalidValue;
}

}  // namespace jaxops::layer_norm
