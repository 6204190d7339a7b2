// Forward launchers: picks the team / block / uncached kernel by row length and pack width.
#include "layer_norm/layer_norm_cuda.h"
#include "layer_norm/layer_norm_kernels.cuh"
#include "layer_norm/layer_norm_launch.cuh"

namespace jaxops::layer_norm {
namespace {

constexpr int kTeamThreads = 128;

template <class T, int kPack, int kPacks, int kWidth, int kRows = 1>
cudaError_t launch_team(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  auto kernel = forward_team<T, kPack, kPacks, kWidth, kRows>;
  int per_sm = 1;
  if (cudaError_t err = prepare(kernel, kTeamThreads, 0, &per_sm); err != cudaSuccess) return err;
  const int64_t teams = kTeamThreads / kWidth * kRows;  // rows per block per iteration
  const int64_t grid = std::min<int64_t>((a.shape.rows + teams - 1) / teams, int64_t{info.sm_count} * per_sm);
  kernel<<<static_cast<unsigned>(grid), kTeamThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Rows of npacks <= 32 packs: one pack per lane, kWidth = next power of two, kRows rows a team.
template <class T, int kPack, int kRows>
cudaError_t launch_narrow_rows(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                               int width) {
  switch (width) {
    case 1: return launch_team<T, kPack, 1, 1, kRows>(a, info, stream);
    case 2: return launch_team<T, kPack, 1, 2, kRows>(a, info, stream);
    case 4: return launch_team<T, kPack, 1, 4, kRows>(a, info, stream);
    case 8: return launch_team<T, kPack, 1, 8, kRows>(a, info, stream);
    case 16: return launch_team<T, kPack, 1, 16, kRows>(a, info, stream);
    default: return launch_team<T, kPack, 1, 32, kRows>(a, info, stream);
  }
}

template <class T, int kPack>
cudaError_t launch_narrow(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream,
                          int width) {
  // 16-bit types: two rows a team (H100, bfloat16 524288x128: 108 vs 113 us). float32 keeps one
  // (two measured 5 % slower: 210 vs 200 us); float64 too (two spilled 40-60 bytes).
  if constexpr (sizeof(T) == 2) return launch_narrow_rows<T, kPack, 2>(a, info, stream, width);
  else return launch_narrow_rows<T, kPack, 1>(a, info, stream, width);
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

template <class T, int kPack>
cudaError_t forward_packed(const ForwardArgs& a, const cuda::DeviceInfo& info, cudaStream_t stream) {
  const int64_t npacks = a.shape.cols / kPack;
  constexpr int64_t kMaxTeamPacks = kPack > 1 ? 32 * std::min(8, 32 / kPack) : 32;
  if (npacks <= 32) return launch_narrow<T, kPack>(a, info, stream, team_width(npacks));
  if (npacks <= kMaxTeamPacks) return launch_wide<T, kPack>(a, info, stream, team_packs(npacks));

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
