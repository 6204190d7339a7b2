// Forward launchers: picks the team / block / uncached kernel by row length and pack width.
#include <algorithm>
#include <cstdlib>

#include "layer_norm/layer_norm_cuda.h"
#include "layer_norm/layer_norm_fwd_kernels.cuh"
#include "layer_norm/layer_norm_launch.cuh"
#include "layer_norm/layer_norm_lean.cuh"
#include "layer_norm/layer_norm_async_fwd.cuh"
#include "layer_norm/layer_norm_lean_block.cuh"
#include "layer_norm/layer_norm_skew_block.cuh"
#include "layer_norm/layer_norm_skew_warp.cuh"

namespace jaxops::layer_norm {
namespace {

constexpr int kTeamThreads = 128;
constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x limit; the kernels' row loops cover the rest

// Grid of a forward kernel handling `per_block` rows a block per loop iteration. Lean kernels:
// one row group per block (grid = number of groups; the hardware refills block slots as blocks
// retire: 1-8 % faster than resident persistent blocks on the H100, session 5, as for softmax);
// older kernels: at most the resident blocks, each looping over many rows.
int64_t forward_grid(int64_t rows, int64_t per_block, bool persistent, int per_sm, const cuda::DeviceInfo& info) {
  const int64_t groups = (rows + per_block - 1) / per_block;
  const int64_t cap = persistent ? int64_t{info.sm_count} * per_sm : kMaxGridX;
  return std::max<int64_t>(1, std::min(groups, cap));
}

template <class Kernel>
cudaError_t launch_team_kernel(Kernel kernel, int kWidth, int kRows, bool persistent, const ForwardArgs& a,
                               const cuda::DeviceInfo& info, cudaStream_t stream) {
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, kTeamThreads, 0, info, &per_sm); err != cudaSuccess) return err;
  const int64_t rows_per_block = kTeamThreads / kWidth * kRows;
  const int64_t grid = forward_grid(a.shape.rows, rows_per_block, persistent, per_sm, info);
  return cuda::launch_kernel(kernel, static_cast<unsigned>(grid), kTeamThreads, 0, stream, a);
}

// Whether the lean kernels (session 5) take these rows: 16-byte packs of float / 16-bit types
// and one parameter group. double and scalar packs keep forward_team / forward_block; per-example
// parameters (vmap: groups > 1) keep forward_team, and past the teams' widths take
// forward_block_lean with kGroups (session 41).
template <class T, int kPack>
bool lean_forward(const ForwardArgs& a) {
  if constexpr (sizeof(T) <= 4 && kPack * sizeof(T) == 16) return a.shape.groups == 1;
  else return false;
}

// Lean kernels exist only for 16-byte packs of float / 16-bit types: instantiated only there.
template <class T, int kPack>
constexpr bool kLeanType = sizeof(T) <= 4 && kPack * sizeof(T) == 16;

// Rows that are not whole 16-byte packs (single-element packs of float / 16-bit types, <= 256
// columns, one parameter group) take the lean team kernels too: one 1 / cols a row, rsqrt, no
// per-element division. H200, session 53 run 1, us (forward_team -> forward_lean): f32
// layer_norm 262144x255 249 -> 156, 1048576x31 233 -> 158, 4096x131 4.31 -> 3.32; bf16 layer_norm
// 508400x132 271 -> 181, 262144x255 155 -> 105; bf16 rms_norm 508400x132 256 -> 156.
// The lean teams' cost a row is mostly fixed (loads of the parameters, shuffle trees, the
// statistics' stores), so rows of few columns go faster on fewer lanes with more elements each:
// more rows a warp. Session 53 runs A-B, us (1048576 rows unless said), before -> after:
//  17-32 columns, 16 lanes of 2 -> 8 lanes of 4: layer_norm 31 f32 158 -> 100, bf16 158 -> 81; 21
//    f32 158 -> 82; rms_norm 31 f32 158 -> 88, bf16 158 -> 80;
//  33-64, 32 lanes of 2 (forward_team) -> 16 lanes of 4: layer_norm 63 f32 295 -> 188, bf16 263 ->
//    160; 33 f32 297 -> 160; rms_norm 63 f32 255 -> 161, bf16 214 -> 158. (8 lanes of 8: 33
//    columns faster again, 63 slower, f32 189 -> 200, bf16 160 -> 189: not taken);
//  65-128, 32 lanes of 4 -> 16 lanes of 8: layer_norm 524288x97 f32 179 -> 154, bf16 159 -> 128;
//    508400x127 f32 181 -> 169, bf16 154 -> 137; rms_norm 97 f32 161 -> 125, bf16 159 -> 81.
template <class T, int kPack>
bool scalar_lean(const ForwardArgs& a) {
  if constexpr (kPack == 1 && sizeof(T) <= 4) return a.shape.groups == 1;
  else return false;
}

template <class T, int kPack, int kPacks, int kWidth, int kRows, bool kLean>
cudaError_t launch_team(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  if constexpr (kLean)
    return launch_team_kernel(forward_lean<T, kPack, kPacks, kWidth, kRows>, kWidth, kRows, false, a, info, stream);
  else
    return launch_team_kernel(forward_team<T, kPack, kPacks, kWidth, kRows>, kWidth, kRows, true, a, info, stream);
}

// Rows of npacks <= 32 packs (older kernels): one pack per lane, kWidth = next power of two, kRows
// rows a team.
template <class T, int kPack, int kRows>
cudaError_t launch_narrow_rows(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                               int width) {
  return with_team_width(width, [&](auto w) {
    return launch_team<T, kPack, 1, decltype(w)::value, kRows, false>(a, info, stream);
  });
}

// Lean kernel, rows of npacks <= 32 16-byte packs. Rows of 1-3 packs: one pack a lane, two
// rows a team, so a lane has two packs in flight. Rows of 4 or 5-32 packs: two packs a lane, one row
// a team of width / 2 lanes: the same bytes in flight a lane, one shuffle level less in each tree
// and half the per-row work a lane. Bit-identical either way: a lane adds its two packs' sums
// where the wider team's xor-width/2 level added the same two.
//
// Measured on the H200 (same process, us). Two rows a team against one (session 47, bf16):
// layer_norm 82.2 -> 73.1, rms_norm 81.0 -> 68.0 at 32-256 columns; four rows spilled (134). Two
// packs a lane against two rows a team: session 48, bf16 layer_norm 524288x128 73.7 -> 71.0,
// 1048576x64 73.8 -> 70.3, 2097152x32 73.9 -> 71.3, 131072x200 35.3 -> 32.8, 262144x256 73.8 ->
// 70.8, 4096x128 2.12 -> 1.89, rms_norm 1.5-4 % faster; session 49, float32 layer_norm 524288x128
// 136.5 -> 134.2, 1048576x64 137.0 -> 135.3, 2097152x32 137.4 -> 131.4, 655360x100 146.0 -> 137.9,
// 4096x128 2.39 -> 2.18, rms_norm 0.2-3 % faster. Not 3 packs on 2 lanes (24 bf16 columns):
// layer_norm level (85.2 -> 84.8), rms_norm 75.8 -> 79.5.
template <class T, int kPack>
cudaError_t launch_narrow_lean(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                               int width) {
  switch (width) {
    case 1: return launch_team<T, kPack, 1, 1, 2, true>(a, info, stream);
    case 2: return launch_team<T, kPack, 1, 2, 2, true>(a, info, stream);
    case 4:
      if (a.shape.cols == 4 * kPack) return launch_team<T, kPack, 2, 2, 1, true>(a, info, stream);
      return launch_team<T, kPack, 1, 4, 2, true>(a, info, stream);
    case 8: return launch_team<T, kPack, 2, 4, 1, true>(a, info, stream);
    case 16: return launch_team<T, kPack, 2, 8, 1, true>(a, info, stream);
    default: return launch_team<T, kPack, 2, 16, 1, true>(a, info, stream);
  }
}

template <class T, int kPack>
cudaError_t launch_narrow(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                          int width) {
  if constexpr (kLeanType<T, kPack>) {
    if (lean_forward<T, kPack>(a)) return launch_narrow_lean<T, kPack>(a, info, stream, width);
  } else if constexpr (kPack == 1 && sizeof(T) <= 4) {
    if (scalar_lean<T, kPack>(a)) {  // 17-32 columns: 8 lanes of 4 (see scalar_lean)
      if (width == 32) return launch_team<T, kPack, 4, 8, 1, true>(a, info, stream);
      return launch_narrow_lean<T, kPack>(a, info, stream, width);
    }
  }
  // forward_team (session 4): 16-bit two rows a team (108 vs 113 us with one), float and double
  // one (float two measured 5 % slower; double two spilled 40-60 bytes).
  return launch_narrow_rows<T, kPack, sizeof(T) == 2 ? 2 : 1>(a, info, stream, width);
}

template <class T, int kPack, int kPacks>
cudaError_t launch_wide_team(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  if constexpr (kLeanType<T, kPack>) {
    if (lean_forward<T, kPack>(a)) return launch_team<T, kPack, kPacks, 32, 1, true>(a, info, stream);
  } else if constexpr (kPack == 1 && sizeof(T) <= 4) {
    if (scalar_lean<T, kPack>(a)) {
      // 33-64 columns 16 lanes of 4, 65-128 16 lanes of 8 (see scalar_lean), float32 129-256 16 of 16.
      if constexpr (kPacks == 2) {
        return launch_team<T, kPack, 4, 16, 1, true>(a, info, stream);
      } else if constexpr (kPacks == 4) {
        return launch_team<T, kPack, 8, 16, 1, true>(a, info, stream);
      } else if constexpr (kPacks == 8 && sizeof(T) == 4) {
        // float32 129-256 columns: 16 lanes of 16, two rows a warp (80 registers, no spill).
        // H100, session 58 run 1, us (32 lanes of 8 -> 16 of 16 / XLA): layer_norm 262144x201
        // 155.6 -> 147.4 / 365.2, 262144x255 187.8 -> 183.2 / 397.6, 508400x132 191.5 -> 191.4 /
        // 208.1; rms_norm 145.6 -> 142.7, 183.5 -> 180.9, 184.2 -> 184.1. 16-bit rows stay on 32
        // lanes: bf16 layer_norm 183 -> 190, 112 -> 120, 104 -> 106 (rms_norm 132 cols 156 -> 144).
        return launch_team<T, kPack, 16, 16, 1, true>(a, info, stream);
      } else {
        return launch_team<T, kPack, kPacks, 32, 1, true>(a, info, stream);
      }
    }
  }
  return launch_team<T, kPack, kPacks, 32, 1, false>(a, info, stream);
}

// Full-warp teams with several 16-byte packs per lane (at most 32 elements per lane).
template <class T, int kPack>
cudaError_t launch_wide(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream, int packs) {
  if constexpr (kPack > 1 || sizeof(T) <= 4) {  // (float64 scalar teams spill)
    if (packs <= 2) return launch_wide_team<T, kPack, 2>(a, info, stream);
    if (packs <= 4 && 4 * kPack <= 32) return launch_wide_team<T, kPack, 4>(a, info, stream);
    if constexpr (8 * kPack <= 32) return launch_wide_team<T, kPack, 8>(a, info, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: the caller checked the capacity
}

// Rows beyond one block's shared memory, split over a cluster of n blocks (Hopper, session 32):
// each block caches ceil(packs / n) packs, about 32 KB (n = 2..16), and the row sums are added
// across the cluster (layer_norm_split.cuh). The row is read once instead of twice by
// forward_uncached. False when no split fits.
//
// Session 38 (H200, runs 2-3): 8 packs a thread, so several blocks of different clusters share an
// SM and one's loads overlap another's reduction and stores. At 4 packs a thread a 32 KB block
// had 512 threads and a 64 KB one 1024 (one block an SM, strictly load -> cluster sum -> store):
// f32 rms_norm 256x262144 431.4 -> 177.7 us (0.44 -> 1.07x XLA), 512x131072 212.7 -> 170.1,
// 1024x65536 177.8 -> 152.8; bf16 rms_norm 128x524288 231.6 -> 107.2, layer_norm 261.6 -> 111.4,
// 256x262144 139.4 -> 99.4. Past 64 KB a block (16 blocks, f32 rows > 256K columns, 16-bit
// > 512K) only one block fits an SM again and forward_uncached is faster (f32 128x524288 rms_norm
// 208.3 us uncached, 240.2 split at 512 threads, 304.6 at 1024). float32 layer_norm now splits
// into 16 as well: one cluster-wide sum a row since session 37 (512x131072 227.2 -> 171.8 us,
// 256x262144 238.5 -> 190.8; the H100's 320.7 -> 389.2 of session 32 had two).
//
// Session 39 (H200, runs 1-2): past 64 KB a block the split no longer gives up to forward_uncached,
// which ran one block a row (32 rows: 32 SMs busy). The 16 blocks of 512 threads cache nothing and
// re-read their parts (kFromL2). bf16 layer_norm 32x2097152 378 -> 137-152 us (0.40 -> 0.98-1.09x
// XLA), 64x1048576 208 -> 127-131; f32 rms_norm 32x2097152 370 -> 238; at 128x524288 (f32 2 MB
// rows) the same as uncached (206-211 against 208 us). 256 threads: about the same for float32
// layer_norm, 5-10 % slower elsewhere; 1024: 0.6-0.8x XLA. Capping the clusters in flight so that
// their rows fit L2 (24 or 12 MB) was slower at every shape: the fewer blocks left the SMs idle.
constexpr int64_t kShareBytes = 32 * 1024, kMaxShareBytes = 64 * 1024;
constexpr int kFromL2Threads = 512;

template <class T, int kPack>
bool forward_split(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream, cudaError_t* status) {
  if constexpr (kLeanType<T, kPack>) {
    if (info.cc_major < 9) return false;
    const bool grouped = a.shape.groups > 1;  // per-example parameters (vmap)
    const int64_t npacks = a.shape.cols / kPack, pack_bytes = kPack * sizeof(T);
    const int64_t n = std::clamp<int64_t>((npacks * pack_bytes + kShareBytes - 1) / kShareBytes, 2, 16);
    const int64_t per = (npacks + n - 1) / n;
    const size_t smem = static_cast<size_t>(per * pack_bytes);
    auto kernel = grouped ? forward_block_lean<T, kPack, true, false, true> : forward_block_lean<T, kPack, true>;
    int threads = block_threads(per, 8);
    size_t launch_smem = smem;
    if (smem > std::min<size_t>(kMaxShareBytes, dynamic_smem_limit(info, 64 * sizeof(float) + 512))) {
      // nothing cached: parts re-read from L2
      kernel = grouped ? forward_block_lean<T, kPack, true, true, true> : forward_block_lean<T, kPack, true, true>;
      threads = kFromL2Threads;
      launch_smem = 0;
    }
    const int64_t resident = cuda::remembered_resident_clusters(kernel, threads, launch_smem, static_cast<int>(n), info);
    if (resident < 1) return false;
    const int64_t clusters = std::min(a.shape.rows, resident);
    *status = cuda::launch_clustered(kernel, clusters * n, threads, launch_smem, static_cast<int>(n), stream, a);
    return true;
  } else {
    return false;
  }
}

// The widest lean team (session 33): a warp per row, 64 values a lane (16-bit 8 packs, float
// 16; 96 / 128 registers, 5 / 4 blocks an SM), where forward_block_lean would take the row. It
// keeps the row in registers (no shared-memory pass, no block barriers) and has 2x the block
// kernel's bytes in flight an SM. H100, session 33 runs 1-2, us (team / block, 16384 and 65536
// rows): layer_norm bf16 1032 28.7 / 41.4, 100.7 / 155.2; 1536 38.0 / 45.9 (XLA 38.4);
// 2048 49.6 / 53.7, 183.0 / 203.3; float32 1536 72.5 / 73.6, 272.5 / 285.2; 1792 83.9 / 83.1,
// 2048 95.2 / 92.2. rms_norm (one block reduction, so the block kernel is cheaper): bf16 1152
// 29.1 / 30.9, 103.8 / 114.8; 1536 38.0 / 37.2, 137.7 / 141.1; 1792 43.5 / 41.7; float32 1032
// 50.1 / 48.6, 1280 60.7 / 57.7. So: 16-bit layer_norm up to 2048 columns, 16-bit rms_norm up
// to 1536, float32 rms_norm never. float32 layer_norm up to 2048 since session 37 (H100 took it
// to 1536 only): H200, team / block, us, 16384 and 65536 rows: 1792 63.0 / 65.6, 235.5 / 250.7;
// 2048 71.7 / 72.5, 267.3 / 278.3 (float32 rms_norm 2048: 70.6 / 66.2, 261.7 / 257.8). Where DRAM
// does not outrun the SMs (cuda::dram_outruns_sms) float32 stays at 1536: H100, session 61, us,
// 32768x2048 team / block 184.1 / 179.8.
// JAXOPS_LN_FWD_WIDE (a test hook, read at every launch): 1 takes the team wherever it fits, 0
// never.
template <class T>
constexpr int kWidestPacks = 64 * static_cast<int>(sizeof(T)) / 16;

template <class T>
bool widest_team(int64_t npacks, bool rms, const cuda::DeviceInfo& info) {
  if (npacks > 32 * kWidestPacks<T>) return false;
  if (const char* e = std::getenv("JAXOPS_LN_FWD_WIDE"); e != nullptr && (e[0] == '0' || e[0] == '1'))
    return e[0] == '1';
  const int64_t cols = npacks * 16 / static_cast<int64_t>(sizeof(T));
  if (sizeof(T) == 2) return !rms || cols <= 1536;
  return !rms && (cols <= 1536 || cuda::dram_outruns_sms(info));
}

// JAXOPS_LN_NO_HELD=1 (a test hook, read at every launch): 16-bit layer_norm rows of 8-16 KB take
// forward_block_lean instead of forward_block_async_held.
bool held_disabled() {
  const char* e = std::getenv("JAXOPS_LN_NO_HELD");
  return e != nullptr && e[0] == '1';
}

// The largest pack (elements per access, up to 16 bytes) that divides `cols` and the alignment of
// x, y, scale and bias.
template <class T>
int forward_pack(const ForwardArgs& a, int64_t cols) {
  const void* ptrs[] = {a.x, a.y, a.scale, a.bias ? a.bias : a.scale};
  return cuda::pack_size_for<T>(cols, ptrs, 4);
}

// Rows that are not whole 16-byte packs in forward_block_skew: one row a block (grid = rows), its
// whole packs cached in shared memory.
template <class T>
cudaError_t launch_skew(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  constexpr int kPack = kVecPack<T>;
  auto kernel = forward_block_skew<T, kPack>;
  const int threads = block_threads(a.shape.cols / kPack, 4);
  const size_t smem = static_cast<size_t>(a.shape.cols / kPack) * 16;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, threads, smem, info, &per_sm); err != cudaSuccess) return err;
  const int64_t grid = forward_grid(a.shape.rows, 1, false, per_sm, info);
  return cuda::launch_kernel(kernel, static_cast<unsigned>(grid), threads, smem, stream, a);
}

// Rows that are not whole 16-byte packs past 256 columns, up to kWarpSkewMaxCols, with one parameter
// group and 16-byte aligned pointers: a warp a row as head / packs / tail (forward_warp_skew).
// Session 56, H100, us, forward_block_lean<T, 1> (257, 509) or forward_block_skew (1001, 2047) /
// forward_warp_skew / XLA: f32 layer_norm 131072x257 174.6 / 94.2 / 143.8, 65536x509 162.0 / 93.3 /
// 116.6, 65536x1001 207.8 / 180.3 / 209.7; bf16 131072x257 169.2 / 62.1 / 128.6, 65536x509 107.0 /
// 50.6 / 81.9, 65536x1001 165.4 / 106.0 / 125.4, but 32768x2047 111.0 / 148.4 / 139.6 (8 packs a
// lane spill), so longer rows keep the block kernel. Not up to 256 columns, where the scalar teams
// stay ahead (bf16 508400x132 183.1 / 205.5, f32 1048576x63 205.6 / 319.4).
constexpr int64_t kWarpSkewMaxCols = 1024;

template <class T>
cudaError_t launch_warp_skew(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  constexpr int kPack = kVecPack<T>;
  const int64_t per_lane = (a.shape.cols / kPack + 31) / 32;
  if (per_lane <= 1) return launch_team_kernel(forward_warp_skew<T, kPack, 1>, 32, 1, false, a, info, stream);
  if (per_lane <= 2) return launch_team_kernel(forward_warp_skew<T, kPack, 2>, 32, 1, false, a, info, stream);
  if constexpr (kWarpSkewMaxCols / kPack > 128)  // (16-bit rows stop at 4 packs a lane)
    if (per_lane > 4) return launch_team_kernel(forward_warp_skew<T, kPack, 8>, 32, 1, false, a, info, stream);
  return launch_team_kernel(forward_warp_skew<T, kPack, 4>, 32, 1, false, a, info, stream);
}

template <class T, int kPack>
cudaError_t forward_packed(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const int64_t npacks = a.shape.cols / kPack;
  // Rows that are not whole 16-byte packs take full-warp teams of 2-8 elements a lane up to 256
  // columns as well (session 51, H200, us, one block a row / team): f32 layer_norm_bwd 1048576x63
  // 1186 / 249, forward 1185 / 361; bf16 layer_norm_bwd 508400x132 771 / 367 (float64 spills).
  constexpr int64_t kMaxTeamPacks = kPack > 1 || sizeof(T) <= 4 ? 32 * std::min(8, 32 / kPack) : 32;
  if (npacks <= 32) return launch_narrow<T, kPack>(a, info, stream, team_width(npacks));
  if (npacks <= kMaxTeamPacks) return launch_wide<T, kPack>(a, info, stream, team_packs(npacks));
  if constexpr (kLeanType<T, kPack>) {
    if (lean_forward<T, kPack>(a) && widest_team<T>(npacks, a.shape.rms, info))
      return launch_team<T, kPack, kWidestPacks<T>, 32, 1, true>(a, info, stream);
  }

  using A = acc_t<T>;
  const int threads = block_threads(npacks, 4);
  const size_t smem = sizeof(T) * static_cast<size_t>(a.shape.cols);
  // layer_norm rows of 32-64 KB split into 2 as well (session 38, H200 run 3, block kernel /
  // split, us): f32 4096x16384 163.3 / 151.3, 8192x16384 320.1 / 297.8; bf16 2048x32768 91.9 /
  // 82.8, 4096x32768 177.0 / 157.7. Not rms_norm (f32 4096x32768 281.1 / 296.0, bf16 8192x16384
  // 135.3 / 147.3), nor rows of 32 KB or less (f32 8192x8192 145.9 / 151.5) or of 128 KB (level).
  if (!a.shape.rms && smem > kShareBytes && smem <= kMaxShareBytes)
    if (cudaError_t status; forward_split<T, kPack>(a, info, stream, &status)) return status;
  if (smem <= dynamic_smem_limit(info, 64 * sizeof(A))) {
    auto kernel = forward_block<T, kPack>;
    bool persistent = true;
    size_t launch_smem = smem;
    // Rows of single elements (not whole 16-byte packs) with one parameter group. Session 55, H100,
    // us, forward_block (persistent, before) / forward_block_lean<T, 1> / forward_block_skew / XLA:
    // f32 layer_norm 65536x1001 319.6 / 222.6 / 207.7 / 209.3, 16384x4095 399.8 / 249.1 / 193.0 /
    // 211.1, 131072x257 230.3 / 174.4 / 283.1 / 143.6; bf16 65536x1001 311.9 / 212.3 / 165.1 /
    // 125.5, 16384x4095 375.4 / 236.0 / 97.9 / 120.2, 131072x257 235.0 / 169.0 / 262.3 / 128.6;
    // rms_norm alike (bf16 16384x4095 334.0 / 190.1 / 93.9 / 106.3). The skewed kernel reads 16-byte
    // packs but runs a block a row: at 32-64 packs most of its threads idle. Since session 56 rows
    // of up to kWarpSkewMaxCols go a warp a row (launch_warp_skew), so the block kernel gets rows of
    // 129 packs and more. The lean scalar kernel keeps rows whose pointers are not 16-byte aligned.
    if constexpr (kPack == 1 && sizeof(T) <= 4) {
      if (a.shape.groups == 1) {
        // (forward_pack over kVecPack columns: whether the pointers alone are 16-byte aligned)
        if (forward_pack<T>(a, kVecPack<T>) == kVecPack<T>)
          return a.shape.cols <= kWarpSkewMaxCols ? launch_warp_skew<T>(a, info, stream)
                                                  : launch_skew<T>(a, info, stream);
        kernel = forward_block_lean<T, kPack>;
        persistent = false;
      }
    }
    // Session 5: the lean block kernel (one row a block, grid = rows) for 16-byte packs of float /
    // 16-bit types.
    if constexpr (kLeanType<T, kPack>) {
      if (lean_forward<T, kPack>(a)) {
        kernel = forward_block_lean<T, kPack>;
        if constexpr (sizeof(T) == 2)  // 48 registers, 5 blocks of 256 an SM (see the kernel)
          if (threads <= 256) kernel = forward_block_lean_256<T, kPack>;
      } else {  // per-example parameters (vmap; session 41: forward_block before)
        kernel = forward_block_lean<T, kPack, false, false, true>;
      }
      persistent = false;
      // layer_norm rows of 16-32 KB (float32: 8-32 KB): the next row by cp.async into a second
      // buffer, persistent (layer_norm_async_fwd.cuh). Session 41, H200, us, lean / async: f32
      // 8192x8192 147.5 / 141.2 (0.859 -> 0.898 of copy), bf16 4096x16384 81.7 / 74.3. Session 46,
      // float32 rows of 8-16 KB: 32768x3072 215.7 / 206.7, 16384x3584 128.2 / 125.0, 16384x3968
      // 141.8 / 139.4, 32768x2560 179.8 / 178.3, 16384x4096 143.4 / 143.3 (143.5 / 141.7, +1 %, in
      // another run). 16-bit rows of 16 KB lost (bf16 8192x8192 73.1 / 75.0). Float32 rows take it
      // only where DRAM outruns the SMs: H100, session 61, us, lean / async: 16384x4096 183.9 /
      // 193.3 (XLA 184.3), 8192x8192 186.5 / 194.1 (XLA 191.6).
      const bool two_rows_fit =  // what both persistent kernels below need: two rows a block
          lean_forward<T, kPack>(a) && !a.shape.rms && 2 * smem <= dynamic_smem_limit(info, 64 * sizeof(A));
      const bool fast_dram = cuda::dram_outruns_sms(info);
      const size_t async_floor = sizeof(T) == 4 ? kShareBytes / 4 : kShareBytes / 2;
      if (two_rows_fit && smem > async_floor && threads <= kAsyncForwardThreads && (sizeof(T) == 2 || fast_dram)) {
        kernel = forward_block_async<T, kPack>;
        launch_smem = 2 * smem;
        persistent = true;
      }
      // 16-bit layer_norm rows of 8-16 KB: the same with the scale and bias held in registers
      // (layer_norm_async_fwd.cuh). Session 46, H200, us, lean / held: bf16 16384x6144 109.4 /
      // 105.1, 8192x8192 73.8 / 72.3, 16384x5120 89.6 / 88.9, 16384x4104 77.8 / 76.9. Not below
      // 8 KB: 16384x4096 71.8 / 76.5 (though 32768x3072 110.7 / 106.9, 32768x2560 97.4 / 93.6).
      // Only where DRAM outruns the SMs: H100, session 61, bf16 8192x8192 lean / held 93.0 / 102.1.
      if constexpr (sizeof(T) == 2) {
        if (two_rows_fit && smem > kShareBytes / 4 && smem <= kShareBytes / 2 && threads <= kHeldForwardThreads &&
            fast_dram && !held_disabled()) {
          kernel = forward_block_async_held<T, kPack>;
          launch_smem = 2 * smem;
          persistent = true;
        }
      }
    }
    int per_sm = 1;
    if (cudaError_t err = prepare(kernel, threads, launch_smem, info, &per_sm); err != cudaSuccess) return err;
    const int64_t grid = forward_grid(a.shape.rows, 1, persistent, per_sm, info);
    return cuda::launch_kernel(kernel, static_cast<unsigned>(grid), threads, launch_smem, stream, a);
  }
  if (cudaError_t status; forward_split<T, kPack>(a, info, stream, &status)) return status;
  auto kernel = forward_uncached<T, kPack>;
  const int big = 1024;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, big, 0, info, &per_sm); err != cudaSuccess) return err;
  const int64_t grid = std::min<int64_t>(a.shape.rows, int64_t{info.sm_count} * per_sm);
  return cuda::launch_kernel(kernel, static_cast<unsigned>(grid), big, 0, stream, a);
}

// Rows of 33-64 8-byte packs (16-bit widths of 132-252 columns that are a multiple of 4 but not
// of 8; float32 even widths of 66-126 not a multiple of 4), one parameter group, on the lean team
// with 8-byte packs instead of single elements on 32 lanes of 8 (or float32's 16 of 8). H200,
// session 59, us (before -> after; XLA): bf16 layer_norm 508400x132 182.2 -> 92.1 (127.4),
// 262144x196 99.1 -> 69.1 (79.2), 262144x252 103.8 -> 82.4 (100.8); bf16 rms_norm 156.0 -> 76.6
// (100.9), 83.2 -> 58.8 (65.0), 85.4 -> 70.5 (79.3); float32 layer_norm 1048576x66 255.8 ->
// 165.8, 524288x126 172.7 -> 141.4; rms_norm 201.4 -> 139.3, 146.9 -> 130.9. Up to 56 packs 8
// lanes of 5-7 (four rows a warp), past that 16 lanes of 4 (8 lanes of 8 lost there: bf16
// layer_norm 252 85.5).
template <class T>
bool half_pack_team(const ForwardArgs& a) {
  constexpr int kHalf = kVecPack<T> / 2;
  const int64_t npacks = a.shape.cols / kHalf;
  if (sizeof(T) > 4 || a.shape.groups != 1 || npacks <= 32 || npacks > 64) return false;
  return forward_pack<T>(a, a.shape.cols) == kHalf;
}

template <class T>
cudaError_t launch_half_team(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  if constexpr (sizeof(T) <= 4) {
    constexpr int kHalf = kVecPack<T> / 2;
    switch ((a.shape.cols / kHalf + 7) / 8) {
      case 5: return launch_team<T, kHalf, 5, 8, 1, true>(a, info, stream);
      case 6: return launch_team<T, kHalf, 6, 8, 1, true>(a, info, stream);
      case 7: return launch_team<T, kHalf, 7, 8, 1, true>(a, info, stream);
      default: return launch_team<T, kHalf, 4, 16, 1, true>(a, info, stream);
    }
  }
  return cudaErrorInvalidValue;  // unreachable: half_pack_team is false past 4-byte types
}

template <class T>
cudaError_t forward_typed(const ForwardArgs& a, cudaStream_t stream) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return err;
  if (half_pack_team<T>(a)) return launch_half_team<T>(a, info, stream);
  if (forward_pack<T>(a, a.shape.cols) == kVecPack<T>)
    return forward_packed<T, kVecPack<T>>(a, info, stream);
  return forward_packed<T, 1>(a, info, stream);
}

}  // namespace

cudaError_t forward_cuda(const ForwardArgs& a, cudaStream_t stream) {
  JAXOPS_DISPATCH_FLOAT(a.dtype, T, return forward_typed<T>(a, stream));
  return cudaErrorInvalidValue;
}

}  // namespace jaxops::layer_norm
