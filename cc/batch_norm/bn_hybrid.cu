// Training forward of batch_norm in one cooperative kernel for inputs larger than the GPU's shared
// memory: each block (one per SM) keeps a slice of x's rows in shared memory and streams a span
// of the others. The streaming path (statistics kernel, merge, apply kernel) reads all of x twice;
// here the slices (about 28 MB on an H100: 14 % of float32 (256,56,56,64), 55 % of bfloat16
// (128,28,28,256)) are read once. Session 14 measured that path at 2.84 TB/s of DRAM traffic for
// float32 (256,56,56,64), the copy's rate being 3.02: reaching 1.3x XLA there (<= 215 us) needs
// fewer bytes, not a faster stream.
//
// Phase 1: every block copies its slice into shared memory and reads its span, folding both into
// per-thread partial statistics as the 16-byte packs arrive (a separate pass over the slice
// would leave DRAM idle), then folds the threads' partials (fold_block). Grid barrier, merge
// (merge_spread, one more barrier). Phase 2: the span is read again, last chunk first (its end,
// read last in phase 1, is still in L2), and normalised; then the slice, from shared memory.
//
// The layout that makes the statistics cheap: a thread loads packs t, t + kThreads, ... of a
// row-aligned run, and kThreads * P is a multiple of C, so every pack a thread reads holds the
// same P channels (C / P a power of two; other channel counts take the streaming kernels).
//
// Measured (H100, session 24, same-run against the streaming path, us): BN+ReLU float32
// (256,56,56,64) 220.1 -> 215.4 (XLA 279.0), (128,28,28,256) 118.6 -> 108.0, (64,56,56,64)
// 66.0 -> 52.0; bfloat16 (256,56,56,64) 120.3 -> 116.7, (128,28,28,256) 67.2 -> 60.8. Phase
// times of float32 (256,56,56,64) (%globaltimer, no chain, forward span order): slice 14.8, span
// 60.2, fold 3.7, barrier 2.5, merge 4.7, apply span 115.6 (3.1 TB/s), apply slice 8.8.
#include <cooperative_groups.h>

#include <cstdint>

#include "batch_norm/bn_launch.h"
#include "batch_norm/bn_math.h"
#include "batch_norm/bn_moments.cuh"
#include "batch_norm/bn_resident.cuh"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"

namespace jaxops::batch_norm {
namespace {

using cuda::from_acc;
using cuda::to_acc;
using namespace resident;

// 16-byte packs a thread has in flight while it folds statistics (float32 64 KB an SM; 16-bit
// types 32 KB: their 8 channels' partials leave no registers for more under the 64 a thread)
// and while it normalises (float32 without a residual 64 KB, else 32 KB plus the residual's).
template <class T>
constexpr int stats_unroll() {
  return sizeof(T) == 4 ? 4 : 2;
}
template <class T, bool kRes>
constexpr int apply_unroll() {
  return sizeof(T) == 4 && !kRes ? 4 : 2;
}

template <class T, int P>
using Row = cuda::Pack<T, P>;

// Folds packs threadIdx.x, + kThreads, ... of the `packs`-pack run at src into rm; kCopy also
// stores them at dst (the shared slice). All loads of a batch are issued before it is folded.
template <class T, int P, bool kCopy>
__device__ __forceinline__ void fold_run(const T* __restrict__ src, T* __restrict__ dst, int64_t packs,
                                         RowMoments<float, P>& rm) {
  constexpr int kStatsUnroll = stats_unroll<T>();
  const Row<T, P>* s = reinterpret_cast<const Row<T, P>*>(src);
  int64_t p = threadIdx.x;
  for (; p + (kStatsUnroll - 1) * kThreads < packs; p += kStatsUnroll * kThreads) {
    Row<T, P> v[kStatsUnroll];
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(s + p + u * kThreads));
      memcpy(&v[u], &w, 16);
    }
    if constexpr (kCopy) {
#pragma unroll
      for (int u = 0; u < kStatsUnroll; ++u) reinterpret_cast<Row<T, P>*>(dst)[p + u * kThreads] = v[u];
    }
    rm.fold_batch(v);
  }
  for (; p < packs; p += kThreads) {
    Row<T, P> v;
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(s + p));
    memcpy(&v, &w, 16);
    if constexpr (kCopy) reinterpret_cast<Row<T, P>*>(dst)[p] = v;
    rm.fold(v);
  }
}

// Folds every thread's partial into the block's and writes it to the block's workspace slot, in
// a fixed order. Thread t holds row t / Q of pack column t % Q (Q = C / P); H = kThreads / C rows
// of all C channels fill the scratch (kThreads records). In round r the threads of rows r * H ...
// (a contiguous kThreads / P of them) store their P channels, and thread (j, c) = (t / C, t % C)
// merges row r * H + j of channel c into its own partial: P rounds, then a tree over j. The
// records sit at c ^ ((c / P) % 8) within a row, so a storing warp's lanes (c = lane * P + k)
// spread over the banks; the readers read a permutation of consecutive records.
// The fold is issue-bound: with 1024 threads every instruction a thread runs costs the SM about 8
// cycles. H100, session 24: a tree over 32 warp holders in chunks of channels (a thread merging
// up to 5 times a chunk, whole warps issuing the stores of 4 lanes) took 4.7 us at float32 C = 64
// and 19.4 us at bfloat16 C = 256, a kernel without the fold 1.2 us.
template <int P>
__device__ __forceinline__ void fold_block(const RowMoments<float, P>& rm, FMoments* red, float* __restrict__ ws,
                                           int C) {
  const int Q = C / P, H = kThreads / C, writers = kThreads / P;
  const int swz = min(C, 8) - 1;  // C is a power of two
  const int j = threadIdx.x / C, c = threadIdx.x % C;
  FMoments acc{0.f, 0.f, 0.f, 0.f};
  for (int r = 0; r < P; ++r) {
    __syncthreads();  // the previous round's readers are done
    const int w = static_cast<int>(threadIdx.x) - r * writers;
    if (w >= 0 && w < writers) {  // warp-uniform
      const int row = w / Q, ch = (threadIdx.x % Q) * P;
#pragma unroll
      for (int k = 0; k < P; ++k) red[row * C + ((ch + k) ^ ((ch / P) & swz))] = rm.channel(k);
    }
    __syncthreads();
    acc.merge(red[j * C + (c ^ ((c / P) & swz))]);
  }
  __syncthreads();
  red[threadIdx.x] = acc;
  fold_lanes(red, j, c, C, H, [](FMoments& d, const FMoments& o) { d.merge(o); });
  if (j == 0) {
    float* p = ws + blockIdx.x * 3 * int64_t(C) + c;
    p[0] = red[c].s;
    p[C] = red[c].m;
    p[2 * C] = red[c].m2;
  }
}

// y, and the mask words, for the n elements (whole P-packs, starting on a row and a mask word) at
// src: global memory for the span, shared for the slice. Warp w takes the run's chunks of 32 P
// elements w, w + kWarps, ...; the warp stride is a multiple of C, so a lane's coefficients stay in
// registers. kReverse walks them last first (the span: session 24, float32 (256,56,56,64) 218.4 ->
// 215.4 us, (128,28,28,256) 111.5 -> 108.0). The pointers step by compile-time strides and only
// the run's last chunk can be partial, so a pack costs no 64-bit index arithmetic or bounds test.
// Session 43 (H200, run 3, same process, bit-identical results): the sm_90 loop had ~118
// instructions a bf16 pack, about half of them indices, tests and the mask store's address; without
// them bf16 BN+ReLU (128,28,28,256) 53.4 -> 52.4 us, (256,56,56,64) 93.2 -> 92.5, float32 83.8 ->
// 82.6 / 161.3 -> 160.7, BN+Add+ReLU level. Predicted -14 % for bf16: the loop issues at half the
// SM's rate, so it waits on latency more than it is bound by its instruction count.
template <class T, int P, bool kRes, bool kReverse>
__device__ __forceinline__ void apply_run(const T* src, const T* __restrict__ res, T* __restrict__ y,
                                          uint32_t* __restrict__ mask, int64_t n, const float4* coef, int C,
                                          bool relu, bool with_mask) {
  constexpr int U = apply_unroll<T, kRes>();
  constexpr int kChunk = 32 * P;
  constexpr int kStride = kWarps * kChunk;  // elements from one of a warp's chunks to its next
  constexpr int kStep = kReverse ? -kStride : kStride;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float sh[P], a[P], b[P];
  static_assert(8 % P == 0, "coef_at(cl + k) == coef_at(cl) + k");
  const float4* cq = coef + coef_at((warp * kChunk + lane * P) % C);
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const float4 q = cq[k];
    sh[k] = q.x;
    a[k] = q.y;
    b[k] = q.z;
  }
  const int64_t total = (n + kChunk - 1) / kChunk;  // the run's chunks; only the last may be partial
  if (warp >= total) return;  // warp-uniform; nothing below synchronises the block
  const int mine = static_cast<int>((total - 1 - warp) / kWarps) + 1;  // this warp's chunks
  // The run's last chunk, where it is this warp's, is its chunk mine - 1: there a lane loads only
  // a pack that exists and stores only a mask word that exists.
  const int last = (total - 1) % kWarps == warp ? mine - 1 : -1;
  const int64_t left = n - (total - 1) * kChunk;  // elements of the last chunk
  const bool tail_pack = lane * P < left, tail_word = lane < P && lane * 32 < left;
  const int k0 = kReverse ? mine - 1 : 0;
  const int64_t e0 = (warp + static_cast<int64_t>(k0) * kWarps) * kChunk;
  const T* s = src + e0 + lane * P;
  const T* r0 = kRes ? res + e0 + lane * P : nullptr;
  T* d = y + e0 + lane * P;
  uint32_t* m = mask + e0 / 32 + lane;
  for (int g = 0; g < mine; g += U, s += U * kStep, r0 += kRes ? U * kStep : 0, d += U * kStep,
           m += U * (kStep / 32)) {  // warp-uniform bounds
    T v[U][P], r[U][P];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kReverse ? k0 - g - u : g + u;
      ok[u] = g + u < mine && (k != last || tail_pack);
      if (ok[u]) {
        const uint4 w = *reinterpret_cast<const uint4*>(s + u * kStep);
        memcpy(&v[u], &w, 16);
        if constexpr (kRes) cuda::load_vec<T, P>(r0 + u * kStep, r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (g + u < mine) {
        const int k = kReverse ? k0 - g - u : g + u;
        uint32_t bits = 0;
        if (ok[u]) {
          bits = normalize_pack<T, P>(v[u], r[u], kRes, sh, a, b, P, relu);
          cuda::store_vec<T, P>(d + u * kStep, v[u]);
        }
        if (with_mask) {
          const uint32_t word = cuda::warp_mask_words<P>(bits);
          if (k == last ? tail_word : lane < P) m[u * (kStep / 32)] = word;
        }
      }
    }
  }
}

template <class T, int P>
__global__ void __launch_bounds__(kThreads, 1)
hybrid_forward_kernel(const T* __restrict__ x, const float* __restrict__ scale, const float* __restrict__ bias,
                      const T* __restrict__ res, T* __restrict__ y, uint32_t* __restrict__ mask,
                      float* __restrict__ mean_out, float* __restrict__ var_out, float* __restrict__ ws,
                      float4* __restrict__ coef_g, Split sp, int C, float eps, bool relu, bool with_mask) {
  cuda::enter_kernel();
  const Smem sm = smem_layout(C);
  T* xs = reinterpret_cast<T*>(sm.data);
  const int64_t e0 = blockIdx.x * sp.rpb * C, n0 = sp.slice_rows(blockIdx.x) * C;
  const int64_t e1 = sp.span_r0(blockIdx.x) * C, n1 = sp.span_rows(blockIdx.x) * C;

  RowMoments<float, P> rm;
  const int Q = C / P, ch = (threadIdx.x % Q) * P;
#pragma unroll
  for (int k = 0; k < P; ++k) rm.piv[k] = pivot_of(to_acc(x[ch + k]));
  // What the merge needs of each channel, fetched now rather than after the merge's tree, where
  // these loads (long evicted from L2) would add a DRAM round trip to the time DRAM sits idle.
  if (static_cast<int>(threadIdx.x) < C)
    sm.coef[coef_at(threadIdx.x)] = make_float4(pivot_of(to_acc(x[threadIdx.x])), scale[threadIdx.x], bias[threadIdx.x], 0.f);
  fold_run<T, P, true>(x + e0, xs, n0 / P, rm);
  fold_run<T, P, false>(x + e1, nullptr, n1 / P, rm);
  fold_block<P>(rm, sm.red, ws, C);
  cooperative_groups::this_grid().sync();

  merge_spread(ws, mean_out, var_out, coef_g, sm, C, eps,
               [&](int64_t bk) { return static_cast<float>(sp.slice_rows(bk) + sp.span_rows(bk)); },
               [&](int c) { return sm.coef[coef_at(c)]; });  // {pivot, scale, bias}, stored at the start
  if (res) {
    apply_run<T, P, true, true>(x + e1, res + e1, y + e1, mask + e1 / 32, n1, sm.coef, C, relu, with_mask);
    apply_run<T, P, true, false>(xs, res + e0, y + e0, mask + e0 / 32, n0, sm.coef, C, relu, with_mask);
  } else {
    apply_run<T, P, false, true>(x + e1, nullptr, y + e1, mask + e1 / 32, n1, sm.coef, C, relu, with_mask);
    apply_run<T, P, false, false>(xs, nullptr, y + e0, mask + e0 / 32, n0, sm.coef, C, relu, with_mask);
  }
}

}  // namespace

cudaError_t hybrid_forward_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                                const void* bias, const void* residual, void* y, uint32_t* mask, void* mean,
                                void* var, void* ws, int64_t cap, void* coef, double eps, bool relu,
                                bool* launched) {
  *launched = false;
  if (!aligned(x) || !aligned(y) || (residual && !aligned(residual))) return cudaSuccess;
  SliceLayout s;
  bool ok = false;
  if (cudaError_t err = slice_layout(v, 1, cap, &s, &ok)) return err;
  if (!ok) return cudaSuccess;
  const int64_t R = v.rows, C = v.channels;
  // Inputs that fit go to the resident kernel (or, with a residual past its limit, to the
  // streaming kernels: this kernel was slower there, bfloat16 (64,56,56,64) 53.7 against 43.1 us).
  if (s.fits(R)) return cudaSuccess;
  // With a residual the apply reads two streams and this kernel has half the bytes in flight of
  // the streaming apply: it lost with the slices holding less than a third of the rows (H100,
  // session 24, BN+Add+ReLU: float32 (256,56,56,64), 14 %: 287.8 against 281.0 us; bfloat16, 28 %:
  // 152.4 against 151.3) and won above (float32 (64,56,56,64), 55 %: 71.9 against 80.1).
  if (residual && 3 * s.blocks * s.rpb < R) return cudaSuccess;
  Split sp = s.split(R, s.rpb);
  const size_t smem = s.smem(C, s.rpb);
  auto go = [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) <= 4) {
      int ci = static_cast<int>(C);
      float ef = static_cast<float>(eps);
      bool re = relu, with_mask = v.mask_words > 0;
      void* args[] = {&x, &scale, &bias, &residual, &y, &mask, &mean, &var, &ws, &coef, &sp, &ci, &ef, &re, &with_mask};
      return launch_resident(hybrid_forward_kernel<T, 16 / sizeof(T)>, s.blocks, smem, s.dev, stream, args,
                             launched);
    }
    return cudaSuccess;
  };
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    if (cudaError_t err = go(T{})) return err;
  });
  return cudaGetLastError();
}

}  // namespace jaxops::batch_norm
