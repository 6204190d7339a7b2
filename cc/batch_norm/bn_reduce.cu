// Per-channel column reductions of batch_norm over (G, R, C) channel-last data:
//   forward  — sum/mean/M2 of x - pivot (per thread: Chan batches of rows, Welford for the last
//              few; Chan merges after; see below),
//   backward — sum(dy') and sum(dy' * (x - mean)), dy' = dy masked by the relu bit.
//
// Pass 1: a block owns a tile of rows x channels of one group. Lanes run along C with 16-byte
// packs (P channels each, so a warp reads contiguous memory), thread rows stride down the tile,
// and a fixed-order tree in shared memory folds the thread rows into one partial per channel,
// written to the workspace slot of the row block. Pass 2: one block per (group, channel) folds
// the row blocks' partials: each thread a few in a fixed order, then a shuffle tree and a tree
// over the warps. (Session 2 had one warp per channel walking up to 1024 partials serially:
// 8 blocks, latency-bound, 55 us.) No atomics: the result depends only on the shape and the
// device's SM count.
#include <algorithm>

#include "batch_norm/bn_launch.h"
#include "batch_norm/bn_math.h"
#include "batch_norm/bn_moments.cuh"
#include "batch_norm/bn_test_hooks.h"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"

namespace jaxops::batch_norm {
namespace {

using cuda::acc_t;
using cuda::to_acc;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // backward: rows loaded before they are folded in (2 x 4 x 16 bytes in flight)

// Forward pass 1: rows (one Chan batch) loaded before they are folded in, and the blocks an SM
// must hold (launch bounds). float32: 8 x 16 B under 3 blocks (80 registers); session 10, H100,
// (256,56,56,64): 4, 6 or 8 rows, 3 or 4 blocks, and loads of the next batch issued before the
// current one is folded all measured 79.2-80.2 us (the kernel reads at ~2.6 TB/s in the
// benchmark's chain, 2.8 TB/s alone under ncu: 83 % of DRAM peak, scoreboard-bound at 24 warps).
// 16-bit types: 6 x 8 B under 3 blocks (77 registers, 46 us); 8 rows spilled at 80 registers;
// 4 blocks (64 registers, 16-20 spilled bytes) 48.7 us; 8 channels a thread (16-byte loads,
// 2 blocks) 52 us. float64: 4 x 16 B.
template <class T>
constexpr int stats_unroll() {
  return sizeof(T) == 2 ? 6 : sizeof(T) == 4 ? 8 : 4;
}
template <class T>
constexpr int stats_min_blocks() {
  return sizeof(T) <= 4 ? 3 : 1;
}

// The P channels of one row: one vector load when the data is aligned for it (kVec), else P
// element loads of the same channels. Only the load instruction depends on where XLA put the
// buffer; the tile, the rows each thread visits and the order of additions do not (session 6:
// the plan used to fall back to P = 1, and so a different summation order, for a misaligned x).
template <class T, int P, bool kVec>
__device__ __forceinline__ cuda::Pack<T, P> load_channels(const T* p) {
  if constexpr (kVec || P == 1) {
    return cuda::load_pack<T, P>(p);
  } else {
    cuda::Pack<T, P> v;
#pragma unroll
    for (int k = 0; k < P; ++k) v.v[k] = p[k];
    return v;
  }
}

template <class T, int P>
bool pack_aligned(const void* p) {
  return !force_element_loads() && reinterpret_cast<uintptr_t>(p) % (sizeof(T) * P) == 0;
}

// Blocks of `Kernel` (kThreads threads) that fit on the whole chip at once (queried once).
template <auto Kernel>
int64_t resident_blocks(int sm_count) {
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0) != cudaSuccess || n < 1) {
      (void)cudaGetLastError();  // do not leave the query's error for the launch check
      n = 1;
    }
    return n;
  }();
  return int64_t(per_sm) * sm_count;
}

// How the (G, R, C) array is cut into blocks.
struct Tile {
  int P = 1;       // channels per thread (pack)
  int tx = 1;      // threads along C
  int ty = 1;      // thread rows
  int64_t ncb = 1; // channel blocks
  int64_t nrb = 1; // row blocks (<= workspace capacity)
  int64_t rpb = 1; // rows per row block
};

// Row blocks: exactly one resident wave of blocks over the chip (`resident`): every
// block starts at once, streams its rows and finishes at once, so the DRAM stream stalls only
// at the start and the end. Session 3 asked for ~8 blocks per SM (about two waves of 4 resident
// blocks, each with a shared-memory tree, a partial store and a block launch in between: 2.72
// TB/s where XLA's reduce reaches 3.0).
// A function of the shape, the dtype's pack and the occupancy only (never of pointer alignment),
// so the order of floating-point additions is too.
Tile plan(const View& v, int pack, int64_t cap, int64_t resident) {
  Tile t;
  t.P = v.channels % pack == 0 ? pack : 1;
  const int64_t lanes = (v.channels + t.P - 1) / t.P;
  t.tx = static_cast<int>(std::min<int64_t>(lanes, 32));
  t.ty = kThreads / t.tx;
  t.ncb = (lanes + t.tx - 1) / t.tx;
  // One resident wave of blocks, each with at least one row per thread row.
  const int64_t want = std::max<int64_t>(1, resident / (v.groups * t.ncb));
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(cap, (v.rows + t.ty - 1) / t.ty));
  t.nrb = std::max<int64_t>(1, std::min(want, most));
  t.rpb = (v.rows + t.nrb - 1) / t.nrb;
  t.nrb = std::max<int64_t>(1, (v.rows + t.rpb - 1) / t.rpb);
  return t;
}

struct BlockPos {
  int64_t g, cb, rb, c0, r0, r1;
  int tx, ty;
  bool active;
};

__device__ __forceinline__ BlockPos block_pos(const Tile& t, int64_t R, int64_t C) {
  BlockPos b;
  const int64_t id = blockIdx.x;
  b.rb = id % t.nrb;
  const int64_t rest = id / t.nrb;
  b.cb = rest % t.ncb;
  b.g = rest / t.ncb;
  b.tx = threadIdx.x % t.tx;
  b.ty = threadIdx.x / t.tx;
  b.c0 = (b.cb * t.tx + b.tx) * t.P;
  b.active = b.ty < t.ty && b.c0 < C;
  b.r0 = b.rb * t.rpb;
  b.r1 = min(R, b.r0 + t.rpb);
  return b;
}

// Largest power of two below n (0 for n <= 1): the first stride of the shared-memory tree.
__device__ __forceinline__ int tree_start(int n) {
  int s = 1;
  while (s * 2 < n) s *= 2;
  return n > 1 ? s : 0;
}

// ---------------------------------------------------------------- forward statistics
//
// Accuracy and non-finite values: see bn_moments.cuh (pivot-shifted partials).
// Workspace slot of a row block, per channel: [0] sum(x - pivot), [1] mean of x - pivot,
// [2] M2. The count of a row block follows from the tiling, so it is not stored.

template <class T, int P, int U, bool kVec>
__global__ void __launch_bounds__(kThreads, stats_min_blocks<T>())
stats_partial_kernel(const T* __restrict__ x, acc_t<T>* __restrict__ ws, int64_t R, int64_t C, Tile t,
                     int64_t cap) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A s_n[kThreads];
  __shared__ A s_sum[kThreads * P];
  __shared__ A s_mean[kThreads * P];
  __shared__ A s_m2[kThreads * P];
  const BlockPos b = block_pos(t, R, C);
  RowMoments<A, P> rm;  // Welford rows and Chan batches of U rows (bn_moments.cuh)
  if (b.active) {
    const T* xg = x + b.g * R * C + b.c0;
    const cuda::Pack<T, P> first = load_channels<T, P, kVec>(xg);  // row 0 of the group: the pivots
#pragma unroll
    for (int k = 0; k < P; ++k) rm.piv[k] = pivot_of(to_acc(first.v[k]));
    const int64_t step = t.ty;
    int64_t r = b.r0 + b.ty;
    // Whole batches of U rows, every load issued before the first fold. With a `break` in the
    // fold loop (session 9's code) ptxas sank each load into its row's branch: one 16-byte load
    // in flight per thread, f32 statistics at 2.44 TB/s (session 10, SASS and trace, H100).
    for (; r + (U - 1) * step < b.r1; r += step * U) {
      cuda::Pack<T, P> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load_channels<T, P, kVec>(xg + (r + u * step) * C);
      rm.fold_batch(v);
    }
    for (; r < b.r1; r += step) rm.fold(load_channels<T, P, kVec>(xg + r * C));  // < U rows left
  }
  const int tid = threadIdx.x;
  s_n[tid] = rm.n;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    s_sum[tid * P + k] = rm.sum[k];
    s_mean[tid * P + k] = rm.mean[k];
    s_m2[tid * P + k] = rm.m2[k];
  }
  for (int s = tree_start(t.ty); s > 0; s /= 2) {
    __syncthreads();
    if (b.active && b.ty < s && b.ty + s < t.ty) {
      const int o = tid + s * t.tx;
      const A nb = s_n[o];
#pragma unroll
      for (int k = 0; k < P; ++k) {
        A nn = s_n[tid];
        chan_merge(nn, s_mean[tid * P + k], s_m2[tid * P + k], nb, s_mean[o * P + k], s_m2[o * P + k]);
        s_sum[tid * P + k] += s_sum[o * P + k];
        if (k == P - 1) s_n[tid] = nn;
      }
    }
  }
  if (b.active && b.ty == 0) {
    A* out = ws + (b.g * cap + b.rb) * 3 * C + b.c0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      out[k] = s_sum[tid * P + k];
      out[C + k] = s_mean[tid * P + k];
      out[2 * C + k] = s_m2[tid * P + k];
    }
  }
}

// ---- pass 2: one block of kMergeThreads per (group, channel) ----
constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMergeBatch = 8;  // partials whose loads a thread issues before it folds them

// Fixed-order fold over the block: thread t has folded partials t, t+kMergeThreads, ... in
// order; then lanes pairwise (xor tree), then warps 0..kMergeWarps-1 in order. Returns the total
// in thread 0.
template <class A>
__device__ __forceinline__ Moments<A> block_merge(Moments<A> v) {
  __shared__ Moments<A> s_w[kMergeWarps];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    Moments<A> o;
    o.n = __shfl_xor_sync(0xffffffffu, v.n, off);
    o.s = __shfl_xor_sync(0xffffffffu, v.s, off);
    o.m = __shfl_xor_sync(0xffffffffu, v.m, off);
    o.m2 = __shfl_xor_sync(0xffffffffu, v.m2, off);
    v.merge(o);
  }
  if (threadIdx.x % 32 == 0) s_w[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kMergeWarps; ++w) v.merge(s_w[w]);
  return v;
}

// Adds the pivot back after the merge (the only rounding of the order of ulp(mean)).
template <class T>
__global__ void __launch_bounds__(kMergeThreads)
stats_merge_kernel(const T* __restrict__ x, const acc_t<T>* __restrict__ ws, acc_t<T>* __restrict__ mean,
                   acc_t<T>* __restrict__ var, int64_t R, int64_t C, int64_t nrb, int64_t rpb, int64_t cap) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const int64_t w = blockIdx.x;  // (group, channel)
  const int64_t g = w / C, c = w - g * C;
  const A* p = ws + g * cap * 3 * C + c;
  Moments<A> v{0, 0, 0, 0};
  for (int64_t j0 = threadIdx.x; j0 < nrb; j0 += int64_t(kMergeThreads) * kMergeBatch) {
    A s[kMergeBatch], m[kMergeBatch], m2[kMergeBatch];
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {  // all loads first: one L2 round trip per batch
      const int64_t j = j0 + int64_t(i) * kMergeThreads;
      if (j < nrb) {
        s[i] = p[j * 3 * C];
        m[i] = p[j * 3 * C + C];
        m2[i] = p[j * 3 * C + 2 * C];
      }
    }
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const int64_t j = j0 + int64_t(i) * kMergeThreads;
      if (j >= nrb) break;
      const A nj = static_cast<A>(min(rpb, R - j * rpb));  // rows of row block j (plan(): all > 0)
      v.merge(Moments<A>{nj, s[i], m[i], m2[i]});
    }
  }
  v = block_merge(v);
  if (threadIdx.x == 0) {
    mean[w] = v.mean(pivot_of(to_acc(x[g * R * C + c])));
    var[w] = v.var();
  }
}

// ---------------------------------------------------------------- backward sums

template <class T, int P, bool kVec>
__global__ void __launch_bounds__(kThreads)
grad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint32_t* __restrict__ mask,
                    const acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ ws, int64_t R, int64_t C,
                    Tile t, int64_t cap, int64_t wpg, bool relu) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A s_1[kThreads * P];
  __shared__ A s_2[kThreads * P];
  const BlockPos b = block_pos(t, R, C);
  A s1[P], s2[P], mu[P];
#pragma unroll
  for (int k = 0; k < P; ++k) s1[k] = s2[k] = mu[k] = 0;
  if (b.active) {
#pragma unroll
    for (int k = 0; k < P; ++k) mu[k] = mean[b.g * C + b.c0 + k];
    const int64_t base = b.g * R * C + b.c0;
    const uint32_t* mg = relu ? mask + b.g * wpg : nullptr;
    for (int64_t r = b.r0 + b.ty; r < b.r1; r += int64_t(t.ty) * kUnroll) {
      cuda::Pack<T, P> g[kUnroll], v[kUnroll];
      uint32_t bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t rr = r + u * t.ty;
        if (rr < b.r1) {
          g[u] = load_channels<T, P, kVec>(dy + base + rr * C);
          v[u] = load_channels<T, P, kVec>(x + base + rr * C);
          bits[u] = relu ? cuda::mask_bits<P>(mg, rr * C + b.c0) : ~0u;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * t.ty >= b.r1) break;
#pragma unroll
        for (int k = 0; k < P; ++k) {
          if (!((bits[u] >> k) & 1u)) continue;  // select, not multiply: a masked NaN/inf dy is dropped
          const A gd = to_acc(g[u].v[k]);
          s1[k] += gd;
          s2[k] += gd * (to_acc(v[u].v[k]) - mu[k]);
        }
      }
    }
  }
  const int tid = threadIdx.x;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    s_1[tid * P + k] = s1[k];
    s_2[tid * P + k] = s2[k];
  }
  for (int s = tree_start(t.ty); s > 0; s /= 2) {
    __syncthreads();
    if (b.active && b.ty < s && b.ty + s < t.ty) {
      const int o = tid + s * t.tx;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        s_1[tid * P + k] += s_1[o * P + k];
        s_2[tid * P + k] += s_2[o * P + k];
      }
    }
  }
  if (b.active && b.ty == 0) {
    A* out = ws + (b.g * cap + b.rb) * 2 * C + b.c0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      out[k] = s_1[tid * P + k];
      out[C + k] = s_2[tid * P + k];
    }
  }
}

// One block per (group, channel), the same fixed order as stats_merge_kernel.
template <class A>
__global__ void __launch_bounds__(kMergeThreads)
grad_merge_kernel(const A* __restrict__ ws, const A* __restrict__ var, A* __restrict__ sum_dy,
                  A* __restrict__ sum_dyxhat, int64_t C, int64_t nrb, int64_t cap, A eps) {
  cuda::enter_kernel();
  __shared__ A s_w[2][kMergeWarps];
  const int64_t w = blockIdx.x;
  const int64_t g = w / C, c = w - g * C;
  const A* p = ws + g * cap * 2 * C + c;
  A s1 = 0, s2 = 0;
  for (int64_t j0 = threadIdx.x; j0 < nrb; j0 += int64_t(kMergeThreads) * kMergeBatch) {
    A a[kMergeBatch], b[kMergeBatch];
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const int64_t j = j0 + int64_t(i) * kMergeThreads;
      a[i] = j < nrb ? p[j * 2 * C] : A(0);
      b[i] = j < nrb ? p[j * 2 * C + C] : A(0);
    }
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      s1 += a[i];
      s2 += b[i];
    }
  }
  s1 = cuda::warp_reduce<cuda::SumOp>(s1);
  s2 = cuda::warp_reduce<cuda::SumOp>(s2);
  if (threadIdx.x % 32 == 0) {
    s_w[0][threadIdx.x / 32] = s1;
    s_w[1][threadIdx.x / 32] = s2;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < kMergeWarps; ++i) {
      s1 += s_w[0][i];
      s2 += s_w[1][i];
    }
    sum_dy[w] = s1;
    sum_dyxhat[w] = s2 * inv_std(var[w], eps);
  }
}

}  // namespace

// Launches pass-1 kernel K<P, kVec>: the tile comes from the shape and the aligned kernel's
// occupancy only; a misaligned x takes the element-load twin with the same tile and order.
template <class T, auto Vec, auto Elem, auto Scalar, class Launch>
cudaError_t launch_pass1(const View& v, int pack, bool aligned, int64_t cap, int sm_count, bool rows_empty,
                         Launch&& launch, Tile* out) {
  const bool packed = v.channels % pack == 0;
  const int64_t resident = packed ? resident_blocks<Vec>(sm_count) : resident_blocks<Scalar>(sm_count);
  Tile t = plan(v, pack, cap, resident);
  if (rows_empty) t.nrb = 0;
  const int64_t blocks = v.groups * t.ncb * t.nrb;
  *out = t;
  return blocks > 0 ? launch(t.P == pack ? (aligned ? Vec : Elem) : Scalar, blocks, t) : cudaSuccess;
}

// The forward's launches (here and apply_cuda) do not overlap the previous kernel: overlapped,
// the streaming forward was 1-2 % slower (session 9, H100, same-run A/B: f32 (256,56,56,64)
// 230.1 -> 232.6 us, (128,28,28,256) 124.6 -> 127.2; the backward gained 0.5-0.7 us).
cudaError_t stats_cuda(cudaStream_t stream, const View& v, const void* x, void* mean, void* var, void* ws,
                       int64_t cap) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    using A = acc_t<T>;
    constexpr int kP = lane_channels<T>();
    auto go = [&](auto kernel, int64_t blocks, const Tile& t) {
      return cuda::launch_serial(kernel, blocks, kThreads, 0, stream, static_cast<const T*>(x), static_cast<A*>(ws),
          v.rows, v.channels, t, cap);
    };
    constexpr int kU = stats_unroll<T>();
    Tile t;
    if (cudaError_t err = launch_pass1<T, stats_partial_kernel<T, kP, kU, true>, stats_partial_kernel<T, kP, kU, false>,
                 stats_partial_kernel<T, 1, kU, true>>(v, kP, pack_aligned<T, kP>(x), cap, info.sm_count, false, go, &t))
      return err;
    if (cudaError_t err = cuda::launch_serial(stats_merge_kernel<T>, v.groups * v.channels, kMergeThreads, 0, stream,
        static_cast<const T*>(x), static_cast<const A*>(ws), static_cast<A*>(mean), static_cast<A*>(var), v.rows,
        v.channels, t.nrb, t.rpb, cap))
      return err;
  });
  return cudaGetLastError();
}

cudaError_t backward_reduce_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                                 const uint32_t* mask, const void* mean, const void* var, void* sum_dy,
                                 void* sum_dyxhat, void* ws, int64_t cap, double eps, bool relu) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    using A = acc_t<T>;
    constexpr int kP = lane_channels<T>();
    const bool aligned = pack_aligned<T, kP>(x) && pack_aligned<T, kP>(dy);
    auto go = [&](auto kernel, int64_t blocks, const Tile& t) {
      return cuda::launch_kernel(kernel, blocks, kThreads, 0, stream, static_cast<const T*>(dy),
          static_cast<const T*>(x), mask, static_cast<const A*>(mean), static_cast<A*>(ws), v.rows, v.channels, t, cap,
          v.mask_words, relu);
    };
    Tile t;  // no rows: nothing to reduce, the merge writes zeros
    if (cudaError_t err = launch_pass1<T, grad_partial_kernel<T, kP, true>, grad_partial_kernel<T, kP, false>,
                 grad_partial_kernel<T, 1, true>>(v, kP, aligned, cap, info.sm_count, v.rows == 0, go, &t))
      return err;
    if (cudaError_t err = cuda::launch_kernel(grad_merge_kernel<A>, v.groups * v.channels, kMergeThreads, 0, stream,
        static_cast<const A*>(ws), static_cast<const A*>(var), static_cast<A*>(sum_dy), static_cast<A*>(sum_dyxhat),
        v.channels, t.nrb, cap, A(eps)))
      return err;
  });
  return cudaGetLastError();
}

}  // namespace jaxops::batch_norm
