// Forward launchers: picks the team / block / uncached kernel by row length and pack width.
#include "layer_norm/layer_norm_cuda.h"
#include "layer_norm/layer_norm_kernels.cuh"
#include "layer_norm/layer_norm_launch.cuh"

namespace jaxops::layer_norm {
namespace {

constexpr int kTeamThreads = 128;

template <class T, int kPack, int kPacks, int kWidth>
cudaError_t launch_team(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  auto kernel = forward_team<T, kPack, kPacks, kWidth>;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, kTeamThreads, 0, &per_sm); err != cudaSuccess) return err;
  const int64_t teams = kTeamThreads / kWidth;
  const int64_t grid = std::min<int64_t>((a.shape.rows + teams - 1) / teams, int64_t{info.sm_count} * per_sm);
  kernel<<<static_cast<unsigned>(grid), kTeamThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Rows of npacks <= 32 packs: one pack per lane, kWidth = next power of two.
template <class T, int kPack>
cudaError_t launch_narrow(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
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

// Full-warp teams with several 16-byte packs per lane (at most 32 elements per lane).
template <class T, int kPack>
cudaError_t launch_wide(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream, int packs) {
  if constexpr (kPack > 1) {
    if (packs <= 2) return launch_team<T, kPack, 2, 32>(a, info, stream);
    if (packs <= 4 && 4 * kPack <= 32) return launch_team<T, kPack, 4, 32>(a, info, stream);
    if constexpr (8 * kPack <= 32) return launch_team<T, kPack, 8, 32>(a, info, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: the caller checked the capacity
}

// Rows of 2048..16384 float (npacks <= 16 * 256): one block per row, the row in registers.
// Of 8 and 16 packs per thread (block = packs / that, rounded up to warps), takes the one with
// the most resident rows per SM (ties: 8, more threads), as the softmax cached path does; the
// grid is that many blocks per SM. 4 packs per thread never won (f32 8192: 2 blocks of 512 vs
// 4 of 128 threads at 16 packs, 128 registers). Returns cudaErrorNotSupported if none fits.
template <class T, int kPack, int kPacks>
cudaError_t try_rows(int64_t npacks, int* best_rows, int* best_packs, int* best_threads) {
  const int64_t t = (npacks + kPacks - 1) / kPacks;
  const int threads = static_cast<int>((t + 31) / 32 * 32);
  if (threads > rows_max_threads(kPacks)) return cudaSuccess;
  int per_sm = 0;
  if (cudaError_t err = prepare(forward_rows<T, kPack, kPacks>, threads, 0, &per_sm); err != cudaSuccess)
    return err;
  if (per_sm > *best_rows) {
    *best_rows = per_sm;
    *best_packs = kPacks;
    *best_threads = threads;
  }
  return cudaSuccess;
}

template <class T, int kPack>
cudaError_t launch_rows(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const int64_t npacks = a.shape.cols / kPack;
  int rows = 0, packs = 0, threads = 0;
  if (cudaError_t err = try_rows<T, kPack, 8>(npacks, &rows, &packs, &threads); err != cudaSuccess) return err;
  if constexpr (sizeof(T) < 8) {  // double at 16 packs (150 registers) would rarely win: untested
    if (cudaError_t err = try_rows<T, kPack, 16>(npacks, &rows, &packs, &threads); err != cudaSuccess) return err;
  }
  if (packs == 0) return cudaErrorNotSupported;
  const int64_t grid = std::min<int64_t>(a.shape.rows, int64_t{info.sm_count} * rows);
  const dim3 g(static_cast<unsigned>(grid)), b(static_cast<unsigned>(threads));
  if constexpr (sizeof(T) < 8) {
    if (packs == 16) {
      forward_rows<T, kPack, 16><<<g, b, 0, stream>>>(a);
      return cudaGetLastError();
    }
  }
  forward_rows<T, kPack, 8><<<g, b, 0, stream>>>(a);
  return cudaGetLastError();
}

template <class T, int kPack>
cudaError_t forward_packed(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const int64_t npacks = a.shape.cols / kPack;
  constexpr int64_t kMaxTeamPacks = kPack > 1 ? 32 * std::min(8, 32 / kPack) : 32;
  if (npacks <= 32) return launch_narrow<T, kPack>(a, info, stream, team_width(npacks));
  if (npacks <= kMaxTeamPacks) return launch_wide<T, kPack>(a, info, stream, team_packs(npacks));

  if constexpr (kPack > 1) {
    if (npacks <= int64_t{16} * rows_max_threads(16)) {
      const cudaError_t err = launch_rows<T, kPack>(a, info, stream);
      if (err != cudaErrorNotSupported) return err;
    }
  }

  using A = acc_t<T>;
  const int threads = block_threads(npacks, 4);
  const size_t smem = sizeof(T) * static_cast<size_t>(a.shape.cols);
  if (smem <= dynamic_smem_limit(info, 64 * sizeof(A))) {
    auto kernel = forward_block<T, kPack>;
    int per_sm = 1;
    if (cudaError_t err = prepare(kernel, threads, smem, &per_sm); err != cudaSuccess) return err;
    const int64_t grid = std::min<int64_t>(a.shape.rows, int64_t{info.sm_count} * per_sm);
    kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(a);
    return cudaGetLastError();
  }
  auto kernel = forward_uncached<T, kPack>;
  const int big = 1024;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, big, 0, &per_sm); err != cudaSuccess) return err;
  const int64_t grid = std::min<int64_t>(a.shape.rows, int64_t{info.sm_count} * per_sm);
  kernel<<<static_cast<unsigned>(grid), big, 0, stream>>>(a);
  return cudaGetLastError();
}

template <class T>
cudaError_t forward_typed(const ForwardArgs& a, cudaStream_t stream) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return err;
  const void* ptrs[] = {a.x, a.y, a.scale, a.bias ? a.bias : a.scale};
  if (cuda::pack_size_for<T>(a.shape.cols, ptrs, 4) == kVecPack<T>)
    return forward_packed<T, kVecPack<T>>(a, info, stream);
  return forward_packed<T, 1>(a, info, stream);
}

}  // namespace

cudaError_t forward_cuda(const ForwardArgs& a, cudaStream_t stream) {
  JAXOPS_DISPATCH_FLOAT(a.dtype, T, return forward_typed<T>(a, stream));
  return cudaErrorInvalidValue;
}

}  // namespace jaxops::layer_norm
