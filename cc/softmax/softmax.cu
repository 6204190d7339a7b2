// CUDA softmax / log_softmax over the last axis, forward and backward.
//
// Three paths by row length, each reading the input once where it can:
//  - warp: rows <= 1024 columns live in registers of a group of 1..32 lanes;
//  - cached: a block (or a Hopper thread-block cluster of up to 16 blocks) caches its slice of
//    the row in shared memory (filled by cp.async for 16-byte packs); cluster partials are
//    combined through distributed shared memory. Block sizes favour several blocks (rows) per SM
//    so one row's barriers overlap other rows' memory traffic. Rows that fit one block's cache
//    budget launch one block per row; longer rows run a persistent grid whose blocks request
//    their next row while writing the current one;
//  - uncached: rows too long for any cluster's shared memory make the fewest passes (online
//    max/sum, then the output pass).
// Masked entries are excluded by loading them as -inf (forward) or 0 (log_softmax backward) and
// forcing their outputs; math is float32 (float64 for float64).
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#include <cuda_pipeline.h>

#include "common/cluster.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_math.cuh"

namespace jaxops::softmax {
namespace {

using namespace jaxops::cuda;

constexpr int kWarpMaxCols = 1024;
constexpr int kWarpBlockThreads = 128;
constexpr size_t kCachedBytesPerBlock = 32 * 1024;  // leaves room for several blocks per SM
constexpr int kUnroll = 4;  // independent 16-byte loads each thread keeps in flight

template <class A> __device__ __forceinline__ A neg_inf() { return -A(INFINITY); }

__device__ __forceinline__ float fast_exp(float v) { return __expf(v); }
__device__ __forceinline__ double fast_exp(double v) { return exp(v); }
__device__ __forceinline__ float log_of(float v) { return logf(v); }
__device__ __forceinline__ double log_of(double v) { return log(v); }

// MaxOp with the one-instruction NaN-propagating max.
struct MaxNanOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return max_nan(a, b); }
  template <class A> __device__ __forceinline__ static A identity() { return -A(INFINITY); }
};

template <class A>
struct RowStats {  // what the forward output needs of its row
  A max, inv_sum, log_sum;
  // Only the statistic the output needs: the log costs ~20 instructions a row, which narrow
  // warp rows (16 values a lane) would otherwise pay on every softmax row.
  __device__ __forceinline__ RowStats(A m, A s, bool log)
      : max(m), inv_sum(log ? A(0) : A(1) / s), log_sum(log ? log_of(s) : A(0)) {}
  __device__ __forceinline__ A out(A v, bool log) const {
    return log ? (v - max) - log_sum : fast_exp(v - max) * inv_sum;
  }
};

template <class A>
__device__ __forceinline__ A masked_out(bool log) {
  return log ? neg_inf<A>() : A(0);
}

// ---------------------------------------------------------------------------------------------
// Warp path: a group of W lanes per row, K packs of P elements per lane, interleaved so each
// pack index is one coalesced access across the group.

// 16-bit rows of up to 16 values a lane are capped at 40 registers (12 blocks a SM, 1536 threads): the
// narrow 16-bit shapes (W = 2, 4) otherwise take 48 and lose a sixth of their rows in flight;
// float32 rows of up to 8 values a lane at 32 (16 blocks, full occupancy, as before session 5).
template <class T, int P, int W, int K>
constexpr int kWarpMinBlocks = sizeof(T) == 2 && K * P <= 16 ? 12 : sizeof(T) == 4 && K * P <= 8 ? 16 : 1;

template <class T, int P, int W, int K>
__global__ void __launch_bounds__(kWarpBlockThreads, (kWarpMinBlocks<T, P, W, K>))
forward_warp(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y, int64_t rows,
             int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  constexpr int N = K * P;
  static_assert(N <= 32, "masked bits live in one word");
  constexpr int kRowsPerWarp = 32 / W;
  const int lane = threadIdx.x % W;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t base = warp * kRowsPerWarp; base < rows; base += nwarps * kRowsPerWarp) {
    const int64_t row = base + (threadIdx.x % 32) / W;
    const bool active = row < rows;
    const T* const xr = x + row * cols;
    A v[K][P];
    uint32_t masked = 0;
    A m = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = (k * W + lane) * P;  // < 2^31: rows here have <= 1024 columns
      if (active && col < cols) {
        const Pack<T, P> pk = load_pack<T, P>(xr + col);
        unpack<T, P>(pk, v[k]);
        if (mask) {
          const Pack<bool, P> mk = load_pack<bool, P>(mask + row * cols + col);
#pragma unroll
          for (int p = 0; p < P; ++p) {
            if (!mk.v[p]) {
              v[k][p] = neg_inf<A>();
              masked |= 1u << (k * P + p);
            }
          }
        }
#pragma unroll
        for (int p = 0; p < P; ++p) m = max_nan(m, v[k][p]);
      }
    }
    m = warp_reduce<MaxNanOp, W>(m);
    const ExpShift<T> ex(m);
    A s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = (k * W + lane) * P;
      if (active && col < cols) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const A e = ex(v[k][p]);
          s += e;
          if (!log) v[k][p] = e;  // softmax's output needs exp once, not twice
        }
      }
    }
    s = warp_reduce<SumOp, W>(s);
    const RowStats<A> st(m, s, log);
    T* const yr = y + row * cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = (k * W + lane) * P;
      if (active && col < cols) {
        A r[P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
          r[p] = log ? st.out(v[k][p], true) : v[k][p] * st.inv_sum;
          if (mask && ((masked >> (k * P + p)) & 1u)) r[p] = masked_out<A>(log);
        }
        store_pack<T, P>(yr + col, repack<T, P>(r));
      }
    }
  }
}

template <class T, int P, int W, int K>
__global__ void __launch_bounds__(kWarpBlockThreads)
backward_warp(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
              T* __restrict__ dx, int64_t rows, int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  constexpr int N = K * P;
  static_assert(N <= 32, "masked bits live in one word");
  constexpr int kRowsPerWarp = 32 / W;
  const int lane = threadIdx.x % W;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t base = warp * kRowsPerWarp; base < rows; base += nwarps * kRowsPerWarp) {
    const int64_t row = base + (threadIdx.x % 32) / W;
    const bool active = row < rows;
    const int64_t off = row * cols;
    A yv[N], gv[N];
    uint32_t masked = 0;
    A s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t col = (int64_t(k) * W + lane) * P;
      if (active && col < cols) {
        const Pack<T, P> py = load_pack<T, P>(y + off + col);
        const Pack<T, P> pg = load_pack<T, P>(dy + off + col);
        Pack<bool, P> mk;
        if (mask) mk = load_pack<bool, P>(mask + off + col);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          A yy = to_acc(py.v[p]), g = to_acc(pg.v[p]);
          if (mask && !mk.v[p]) {
            g = 0;
            masked |= 1u << (k * P + p);
          }
          yv[k * P + p] = yy;
          gv[k * P + p] = g;
          s += log ? g : yy * g;
        }
      }
    }
    s = warp_reduce<SumOp, W>(s);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t col = (int64_t(k) * W + lane) * P;
      if (active && col < cols) {
        Pack<T, P> out;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const A yy = yv[k * P + p], g = gv[k * P + p];
          A r = log ? g - fast_exp(yy) * s : yy * (g - s);
          if ((masked >> (k * P + p)) & 1u) r = 0;
          out.v[p] = from_acc<T>(r);
        }
        store_pack<T, P>(dx + off + col, out);
      }
    }
  }
}

template <int V> using IC = std::integral_constant<int, V>;

// Calls f(IC<W>, IC<K>) with the smallest warp shape that holds `cols` columns in packs of P
// with at least MinK packs a lane. The forward asks for MinK = 2: a warp then covers two short
// rows (or twice the bytes of one) per iteration, doubling the independent loads each warp
// keeps in flight, which short rows need to saturate DRAM.
template <int P, int MinK, class F>
cudaError_t with_warp_shape(int64_t cols, F&& f) {
  static_assert(MinK == 1 || MinK == 2, "warp shapes exist for one or two packs a lane");
  const int64_t packs = ceil_div<int64_t>(cols, P);
  if constexpr (MinK == 1) {
    if (packs <= 1) return f(IC<1>{}, IC<1>{});
    if (packs <= 2) return f(IC<2>{}, IC<1>{});
    if (packs <= 4) return f(IC<4>{}, IC<1>{});
    if (packs <= 8) return f(IC<8>{}, IC<1>{});
    if (packs <= 16) return f(IC<16>{}, IC<1>{});
    if (packs <= 32) return f(IC<32>{}, IC<1>{});
  } else {
    if (packs <= 2) return f(IC<1>{}, IC<2>{});
    if (packs <= 4) return f(IC<2>{}, IC<2>{});
    if (packs <= 8) return f(IC<4>{}, IC<2>{});
    if (packs <= 16) return f(IC<8>{}, IC<2>{});
    if (packs <= 32) return f(IC<16>{}, IC<2>{});
  }
  if (packs <= 64) return f(IC<32>{}, IC<2>{});
  if (packs <= 128) return f(IC<32>{}, IC<4>{});
  if constexpr (P <= 4) {
    if (packs <= 256) return f(IC<32>{}, IC<8>{});
  }
  if constexpr (P <= 2) {
    if (packs <= 512) return f(IC<32>{}, IC<16>{});
  }
  if constexpr (P == 1) {
    if (packs <= 1024) return f(IC<32>{}, IC<32>{});
  }
  return cudaErrorInvalidValue;
}

// The warp backward's grid: at most 32 blocks an SM, each looping over row groups (the backward
// was not measured with one row group per warp).
int64_t warp_grid(int64_t rows, int width, const DeviceInfo& dev) {
  const int64_t rows_per_block = kWarpBlockThreads / 32 * (32 / width);
  return std::min<int64_t>(ceil_div<int64_t>(rows, rows_per_block), int64_t(dev.sm_count) * 32);
}

// The warp forward's grid: one row group per warp, as many blocks as the rows need (5-10 % faster
// than a persistent grid of 32 blocks an SM for bf16, 3-5 % for float32; session 5). The kernel
// still loops over row groups, which only grids of more than 2^31 - 1 blocks need.
int64_t forward_warp_grid(int64_t rows, int width) {
  const int64_t rows_per_block = kWarpBlockThreads / 32 * (32 / width);
  return std::min<int64_t>(ceil_div<int64_t>(rows, rows_per_block), INT32_MAX);
}

// ---------------------------------------------------------------------------------------------
// Cached path: the cluster's blocks split each row into slices of `slice` columns; each thread
// only ever touches its own packs of the shared-memory cache, so the cache needs no barriers.

// 16-byte packs can be copied global -> shared asynchronously (cp.async, sm_80+).
template <class T, int P>
constexpr bool kAsyncPack = sizeof(Pack<T, P>) == 16;

// Requests this thread's packs of an unmasked slice into the cache, asynchronously: the whole
// slice is in flight at once and holds no registers.
template <class T, int P>
__device__ __forceinline__ void request_slice_async(const T* __restrict__ src, T* cache, unsigned npacks) {
  static_assert(kAsyncPack<T, P>, "cp.async copies 16-byte packs");
  for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x)
    __pipeline_memcpy_async(cache + i * P, src + i * P, sizeof(Pack<T, P>));
  __pipeline_commit();
}

// Waits for this thread's requested packs and returns their max. Each thread reads back only
// the packs it requested itself, so no barrier is needed.
template <class T, int P>
__device__ __forceinline__ acc_t<T> max_of_requested(const T* cache, unsigned npacks) {
  using A = acc_t<T>;
  __pipeline_wait_prior(0);
  A m = neg_inf<A>();
#pragma unroll 4
  for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x)
    m = pack_max<T, P>(m, load_pack<T, P>(cache + i * P));
  return m;
}

// Same through registers, kUnroll loads in flight a thread; masked entries are cached as -inf.
template <class T, int P>
__device__ __forceinline__ acc_t<T> cache_slice(const T* __restrict__ src, const bool* __restrict__ mask,
                                                T* cache, unsigned npacks) {
  using A = acc_t<T>;
  A m = neg_inf<A>();
  for (unsigned i0 = threadIdx.x; i0 < npacks; i0 += kUnroll * blockDim.x) {
    Pack<T, P> pk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned i = i0 + u * blockDim.x;
      if (i < npacks) pk[u] = load_pack<T, P>(src + i * P);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned i = i0 + u * blockDim.x;
      if (i < npacks) {
        if (mask) {
          const Pack<bool, P> mk = load_pack<bool, P>(mask + i * P);
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (!mk.v[p]) pk[u].v[p] = from_acc<T>(neg_inf<A>());
        }
        m = pack_max<T, P>(m, pk[u]);
        store_pack<T, P>(cache + i * P, pk[u]);
      }
    }
  }
  return m;
}

// kMaskable = false compiles the unmasked kernel alone (mask_arg is ignored): without the
// register-staged masked load path it needs far fewer registers, so more blocks (rows) fit an SM
// where shared memory allows (16-byte packs only: every unmasked row then takes cp.async).
// kPairStats: each thread sums exp over its own packs at its own max, and one (max, sum) reduction
// (MaxSumOp) gives the row's statistics, so the blocks of a cluster meet once a row; otherwise the
// row max is reduced first, then the sum of exp at that max (two block and cluster reductions),
// and softmax's output pass scales the exp cached by the sum pass instead of recomputing it.
// Which one wins depends on the cluster size (kPairStatsMinCluster).
//
// The cache is aligned to 128 bytes, and every extern __shared__ declaration in this file must say
// so (nvcc keeps one alignment for the shared symbol): the dynamic region starts after the static
// shared memory, and when that left it 16 bytes off a 32-byte boundary (304 bytes of statics,
// session 12) every cached forward ran ~10 % slower (H100, f32 16384x4096 179.6 -> 198.6 us),
// the cp.async fills landing across shared-memory sectors.
template <class T, int P, bool kMaskable, bool kPairStats>
__global__ void __launch_bounds__(1024)
forward_cached(const T* __restrict__ x, const bool* __restrict__ mask_arg, T* __restrict__ y, int64_t rows,
               int64_t cols, int64_t slice, bool log) {
  cuda::enter_kernel();
  static_assert(kMaskable || kAsyncPack<T, P>, "the unmaskable kernel copies 16-byte packs");
  using A = acc_t<T>;
  using Stat = std::conditional_t<kPairStats, MaxSum<A>, A>;
  const bool* const mask = kMaskable ? mask_arg : nullptr;
  extern __shared__ __align__(128) unsigned char smem[];
  T* cache = reinterpret_cast<T*>(smem);
  __shared__ Stat scratch[33];
  __shared__ Stat slots[2], bcast[2];
  const unsigned nblocks = cluster_blocks(), rank = cluster_rank();
  const int64_t begin = int64_t(rank) * slice;
  // A slice fits one block's shared memory, so the cache loops index packs in 32 bits, unsigned:
  // a global address is then one IMAD.WIDE.U32 off the row base (no sign extension per pack).
  const unsigned npacks = begin < cols ? unsigned((std::min(cols, begin + slice) - begin) / P) : 0;
  // Unmasked 16-byte packs in a persistent grid (long rows; see unmasked_cached_grid): each
  // thread requests its packs of the block's next row right after writing its output for them
  // (it owns those cache entries, so no barrier), so the next row's loads are in flight during
  // this row's output pass. Without it all blocks of the persistent grid load, reduce and write
  // in step, and DRAM idles while they all reduce. With one block per row it never fires.
  const bool async = kAsyncPack<T, P> && mask == nullptr;
  const int64_t stride = gridDim.x / nblocks;
  bool requested = false;  // this row's packs already requested during the previous row
  [[maybe_unused]] int parity = 0;  // kPairStats: one cluster reduction a row, alternating slots
  for (int64_t row = blockIdx.x / nblocks; row < rows; row += stride) {
    const int64_t off = row * cols + begin;
    A m;
    if constexpr (kAsyncPack<T, P>) {
      if (async) {
        if (!requested) request_slice_async<T, P>(x + off, cache, npacks);
        m = max_of_requested<T, P>(cache, npacks);
      } else {
        m = cache_slice<T, P>(x + off, mask + off, cache, npacks);
      }
    } else {
      m = cache_slice<T, P>(x + off, mask ? mask + off : nullptr, cache, npacks);
    }
    A s = 0;
    if constexpr (kPairStats) {
      const ExpShift<T> thread_ex(sum_shift(m));
      for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
        A v[P];
        unpack<T, P>(load_pack<T, P>(cache + i * P), v);
#pragma unroll
        for (int p = 0; p < P; ++p) s += thread_ex(v[p]);
      }
      MaxSum<A> ms = block_reduce<MaxSumOp>(MaxSum<A>{m, s}, scratch);
      ms = cluster_allreduce<MaxSumOp>(ms, &slots[parity], &bcast[parity]);
      parity ^= 1;
      m = ms.max;
      s = ms.sum;
    } else {
      m = block_reduce<MaxNanOp>(m, scratch);
      m = cluster_allreduce<MaxNanOp>(m, &slots[0], &bcast[0]);
      const ExpShift<T> ex(m);
      for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
        A v[P];
        unpack<T, P>(load_pack<T, P>(cache + i * P), v);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          v[p] = ex(v[p]);
          s += v[p];
        }
        if (!log) store_pack<T, P>(cache + i * P, repack<T, P>(v));
      }
      s = block_reduce<SumOp>(s, scratch);
      s = cluster_allreduce<SumOp>(s, &slots[1], &bcast[1]);
    }
    const RowStats<A> st(m, s, log);
    const ExpShift<T> ex(m);
    const bool prefetch = async && row + stride < rows;
    const T* next = prefetch ? x + (row + stride) * cols + begin : x;
    T* const out = y + off;  // pack addresses: one IMAD.WIDE.U32 off this base
    // One loop per output kind, so the loop body carries no branch on `log`.
    const auto output_pass = [&](auto log_kind) {
      constexpr bool kLog = decltype(log_kind)::value;
      for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
        A v[P];
        unpack<T, P>(load_pack<T, P>(cache + i * P), v);
#pragma unroll
        for (int p = 0; p < P; ++p) {
          if constexpr (kLog) {
            v[p] = st.out(v[p], true);
          } else {
            v[p] = (kPairStats ? ex(v[p]) : v[p]) * st.inv_sum;  // else the cache holds the exp
          }
        }
        if (mask) {
          const Pack<bool, P> mk = load_pack<bool, P>(mask + off + i * P);
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (!mk.v[p]) v[p] = masked_out<A>(kLog);
        }
        store_pack<T, P>(out + i * P, repack<T, P>(v));
        // The entry was read above by this thread alone: it may now be overwritten.
        if constexpr (kAsyncPack<T, P>) {
          if (prefetch) __pipeline_memcpy_async(cache + i * P, next + i * P, sizeof(Pack<T, P>));
        }
      }
    };
    if (log) {
      output_pass(std::true_type{});
    } else {
      output_pass(std::false_type{});
    }
    if constexpr (kAsyncPack<T, P>) {
      if (prefetch) __pipeline_commit();
    }
    requested = prefetch;
  }
  if (nblocks > 1) cluster_sync();  // peers may still read this block's slots
}

template <class T, int P>
__global__ void __launch_bounds__(1024)
backward_cached(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
                T* __restrict__ dx, int64_t rows, int64_t cols, int64_t slice, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* cache_y = reinterpret_cast<T*>(smem);
  T* cache_g = cache_y + slice;
  __shared__ A scratch[33];
  __shared__ A slots[2], bcast[2];
  const unsigned nblocks = cluster_blocks(), rank = cluster_rank();
  const int64_t begin = int64_t(rank) * slice;
  const int64_t npacks = begin < cols ? (std::min(cols, begin + slice) - begin) / P : 0;
  int parity = 0;
  for (int64_t row = blockIdx.x / nblocks; row < rows; row += gridDim.x / nblocks, parity ^= 1) {
    const int64_t off = row * cols + begin;
    A s = 0;
    // Two inputs a pack: half the unroll keeps the loads in registers for 2-byte types.
    constexpr int U = sizeof(T) == 2 ? kUnroll / 2 : kUnroll;
    for (int64_t i0 = threadIdx.x; i0 < npacks; i0 += U * blockDim.x) {
      Pack<T, P> py[U], pg[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < npacks) {
          py[u] = load_pack<T, P>(y + off + i * P);
          pg[u] = load_pack<T, P>(dy + off + i * P);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < npacks) {
          if (mask) {
            const Pack<bool, P> mk = load_pack<bool, P>(mask + off + i * P);
#pragma unroll
            for (int p = 0; p < P; ++p)
              if (!mk.v[p]) pg[u].v[p] = from_acc<T>(A(0));
          }
#pragma unroll
          for (int p = 0; p < P; ++p) {
            const A g = to_acc(pg[u].v[p]);
            s += log ? g : to_acc(py[u].v[p]) * g;
          }
          store_pack<T, P>(cache_y + i * P, py[u]);
          store_pack<T, P>(cache_g + i * P, pg[u]);
        }
      }
    }
    s = block_reduce<SumOp>(s, scratch);
    // One reduction per row: alternate slots so a fast block never overwrites a slot a peer
    // has yet to read.
    s = cluster_allreduce<SumOp>(s, &slots[parity], &bcast[parity]);
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> py = load_pack<T, P>(cache_y + i * P);
      const Pack<T, P> pg = load_pack<T, P>(cache_g + i * P);
      Pack<T, P> out;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const A yy = to_acc(py.v[p]), g = to_acc(pg.v[p]);
        out.v[p] = from_acc<T>(log ? g - fast_exp(yy) * s : yy * (g - s));
      }
      if (mask && log) {
        const Pack<bool, P> mk = load_pack<bool, P>(mask + off + i * P);
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (!mk.v[p]) out.v[p] = from_acc<T>(A(0));
      }
      store_pack<T, P>(dx + off + i * P, out);
    }
  }
  if (nblocks > 1) cluster_sync();
}

// The unmasked backward for 16-byte packs on a persistent grid (long rows, clusters), built like
// the lean forward: each thread requests its packs of y and dy by cp.async (the whole slice in
// flight, no registers held), sums from the cache, and after writing its dx pack i requests
// pack i of the block's next row into the same two entries (it alone reads and writes them, so
// no barrier). With prefetch_bytes > 0 (one block per SM only, see l2_prefetch_bytes) L2 also
// fetches the head of the next row (prefetch_bytes per array) from the moment this row has
// arrived, so DRAM keeps working while every block of the grid reduces. Session 6 (H100, without
// the prefetch): bf16 backward 153 -> 142 us, float32 at several blocks per SM within 1-3 %.
// Session 5: the register-staged kernel above loaded, reduced and wrote in step at one block per
// SM (f32 256x262144: 0.79 of the 3-pass bound) and was issue-heavy for bf16 (0.87).
template <class T, int P>
__global__ void __launch_bounds__(1024)
backward_cached_lean(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows,
                     int64_t cols, int64_t slice, unsigned prefetch_bytes, bool log) {
  cuda::enter_kernel();
  static_assert(kAsyncPack<T, P>, "the lean backward copies 16-byte packs");
  using A = acc_t<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* cache_y = reinterpret_cast<T*>(smem);
  T* cache_g = cache_y + slice;
  __shared__ A scratch[33];
  __shared__ A slots[2], bcast[2];
  const unsigned nblocks = cluster_blocks(), rank = cluster_rank();
  const int64_t begin = int64_t(rank) * slice;
  const unsigned npacks = begin < cols ? unsigned((std::min(cols, begin + slice) - begin) / P) : 0;
  const unsigned l2_bytes = std::min<unsigned>(prefetch_bytes, npacks * unsigned(sizeof(Pack<T, P>)));
  const int64_t stride = gridDim.x / nblocks;
  bool requested = false;  // this row's packs already requested during the previous row
  int parity = 0;          // one cluster reduction a row: alternate its slots
  for (int64_t row = blockIdx.x / nblocks; row < rows; row += stride, parity ^= 1) {
    const int64_t off = row * cols + begin;
    if (!requested) {
      request_slice_async<T, P>(y + off, cache_y, npacks);
      request_slice_async<T, P>(dy + off, cache_g, npacks);
    }
    __pipeline_wait_prior(0);
    const bool has_next = row + stride < rows;
    const int64_t next_off = off + stride * cols;
    if (l2_bytes && has_next) {
      prefetch_l2(y + next_off, l2_bytes);
      prefetch_l2(dy + next_off, l2_bytes);
    }
    A s = 0;
#pragma unroll 4
    for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
      A yv[P], gv[P];
      unpack<T, P>(load_pack<T, P>(cache_y + i * P), yv);
      unpack<T, P>(load_pack<T, P>(cache_g + i * P), gv);
#pragma unroll
      for (int p = 0; p < P; ++p) s = log ? s + gv[p] : fmaf(yv[p], gv[p], s);
    }
    s = block_reduce<SumOp>(s, scratch);
    s = cluster_allreduce<SumOp>(s, &slots[parity], &bcast[parity]);
    T* const out = dx + off;
    const T* const next_y = has_next ? y + next_off : y;
    const T* const next_g = has_next ? dy + next_off : dy;
    // One loop per output kind, so the loop body carries no branch on `log`.
    const auto output_pass = [&](auto log_kind) {
      constexpr bool kLog = decltype(log_kind)::value;
      for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
        A yv[P], gv[P];
        unpack<T, P>(load_pack<T, P>(cache_y + i * P), yv);
        unpack<T, P>(load_pack<T, P>(cache_g + i * P), gv);
#pragma unroll
        for (int p = 0; p < P; ++p)
          yv[p] = kLog ? fmaf(-exp2_ftz(yv[p] * kLog2e), s, gv[p]) : yv[p] * (gv[p] - s);
        store_pack<T, P>(out + i * P, repack<T, P>(yv));
        // Both entries were read above by this thread alone: they may now be overwritten.
        if (has_next) {
          __pipeline_memcpy_async(cache_y + i * P, next_y + i * P, sizeof(Pack<T, P>));
          __pipeline_memcpy_async(cache_g + i * P, next_g + i * P, sizeof(Pack<T, P>));
        }
      }
    };
    if (log) {
      output_pass(std::true_type{});
    } else {
      output_pass(std::false_type{});
    }
    if (has_next) __pipeline_commit();
    requested = has_next;
  }
  if (nblocks > 1) cluster_sync();  // peers may still read this block's slots
}

// ---------------------------------------------------------------------------------------------
// Uncached path: one block per row, online (max, sum) in the first pass, output in the second.

template <class A>
__device__ __forceinline__ void online_update(A& m, A& s, A a) {
  if (a != a) {
    m = a;
    s = a;
  } else if (a > m) {
    s = s * fast_exp(m - a) + A(1);
    m = a;
  } else if (a > neg_inf<A>()) {
    s += fast_exp(a - m);
  }
}

template <class T, int P>
__global__ void __launch_bounds__(1024)
forward_uncached(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y, int64_t rows,
                 int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A scratch[33];
  const int64_t npacks = cols / P;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    A m = neg_inf<A>(), s = 0;
    for (int64_t i0 = threadIdx.x; i0 < npacks; i0 += kUnroll * blockDim.x) {
      Pack<T, P> pk[kUnroll];
      Pack<bool, P> mk[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < npacks) {
          pk[u] = load_pack<T, P>(x + off + i * P);
          if (mask) mk[u] = load_pack<bool, P>(mask + off + i * P);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * blockDim.x < npacks) {
#pragma unroll
          for (int p = 0; p < P; ++p)
            online_update(m, s, (mask && !mk[u].v[p]) ? neg_inf<A>() : to_acc(pk[u].v[p]));
        }
      }
    }
    const A row_max = block_reduce<MaxOp>(m, scratch);
    // Rescale each thread's sum to the row max; threads that saw only -inf contribute nothing.
    const A scaled = s == A(0) ? A(0) : s * fast_exp(m - row_max);
    const RowStats<A> st(row_max, block_reduce<SumOp>(scaled, scratch), log);
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> pk = load_pack<T, P>(x + off + i * P);
      Pack<bool, P> mk;
      if (mask) mk = load_pack<bool, P>(mask + off + i * P);
      Pack<T, P> out;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const bool off_mask = mask && !mk.v[p];
        out.v[p] = from_acc<T>(off_mask ? masked_out<A>(log) : st.out(to_acc(pk.v[p]), log));
      }
      store_pack<T, P>(y + off + i * P, out);
    }
  }
}

template <class T, int P>
__global__ void __launch_bounds__(1024)
backward_uncached(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
                  T* __restrict__ dx, int64_t rows, int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A scratch[33];
  const int64_t npacks = cols / P;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    A s = 0;
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> pg = load_pack<T, P>(dy + off + i * P);
      if (log) {
        Pack<bool, P> mk;
        if (mask) mk = load_pack<bool, P>(mask + off + i * P);
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (!mask || mk.v[p]) s += to_acc(pg.v[p]);
      } else {
        const Pack<T, P> py = load_pack<T, P>(y + off + i * P);
#pragma unroll
        for (int p = 0; p < P; ++p) s += to_acc(py.v[p]) * to_acc(pg.v[p]);
      }
    }
    s = block_reduce<SumOp>(s, scratch);
    for (int64_t i = threadIdx.x; i < npacks; i += blockDim.x) {
      const Pack<T, P> py = load_pack<T, P>(y + off + i * P);
      const Pack<T, P> pg = load_pack<T, P>(dy + off + i * P);
      Pack<bool, P> mk;
      if (mask && log) mk = load_pack<bool, P>(mask + off + i * P);
      Pack<T, P> out;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const A yy = to_acc(py.v[p]), g = to_acc(pg.v[p]);
        A r = log ? g - fast_exp(yy) * s : yy * (g - s);
        if (mask && log && !mk.v[p]) r = 0;
        out.v[p] = from_acc<T>(r);
      }
      store_pack<T, P>(dx + off + i * P, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host dispatch.

struct CachedPlan {
  int64_t max_clusters = 0;  // clusters resident at once: the persistent grid
  int cluster = 1;
  int64_t slice = 0;  // columns per block, a multiple of the pack
  int threads = 0;
  size_t smem = 0;
};

// Block sizes the cached kernels may use, largest first. A block's phases (load, reduce, exp,
// write) serialize behind block and cluster barriers; only other rows' blocks on the same SM
// keep DRAM busy meanwhile, so the plan takes the block size that fits the most blocks (rows)
// per SM, the larger block on a tie. A thread handles at most kMaxPacksPerThread packs (four
// batches of kUnroll loads) so a row's load phase stays a few round trips long.
constexpr int kCachedThreads[] = {1024, 512, 256, 128};
constexpr int64_t kMaxPacksPerThread = 4 * kUnroll;

// Slice budget of the unmaskable forward's rows longer than kCachedBytesPerBlock. H100, session 8
// (64 KB against 32 KB, same run): f32 512x131072 201.3 -> 196.2 us (clusters of 8 instead of 16),
// 2048x32768 196.8 -> 194.3 (2 instead of 4), bf16 2048x32768 104.4 -> 100.1 (one block of 64 KB
// instead of 2 of 32 KB); rows already at 16 blocks of 64 KB (f32 262144) unchanged; 16 KB was
// slower or equal everywhere, 128 KB (one block an SM) 15-30 % slower. The backward keeps 32 KB
// (unmeasured with 64).
constexpr size_t kForwardLongSliceBytes = 64 * 1024;

// Smallest cluster whose unmasked forward takes one (max, sum) reduction a row (forward_cached's
// kPairStats). H100, session 12, same build, µs two reductions -> one: 4-16 block clusters gain
// (f32 256x262144 (16 blocks) 202.3-204.3 -> 191.0-192.2, 512x131072 (8) 196.9-197.1 -> 192.5-193.9;
// bf16 262144 (8) 103.8-104.1 -> 99.9-100.1, 131072 (4) 103.1-103.2 -> 101.5-101.6), while one- or
// two-block plans lose (f32 2048x32768 (2) 194.0-194.7 -> 197.1-197.3, bf16 32768 (1) 98.9-99.8 ->
// 102.2-102.4): the fewer blocks meet, the less a cluster barrier costs against the pair
// reduction's longer shuffle chain and softmax's second exp; <= 8192 columns are equal.
constexpr int kPairStatsMinCluster = 4;

// Picks the smallest cluster whose blocks each cache at most kCachedBytesPerBlock of the row, or
// `long_row_slice` when the row is longer than that (more if the cluster limit is reached); false
// when even the largest cluster cannot cache it.
template <class Kernel>
bool plan_cached(Kernel kernel, int64_t cols, int pack, size_t bytes_per_col, size_t long_row_slice,
                 const DeviceInfo& dev, CachedPlan* plan) {
  const int max_cluster = dev.cc_major >= 9 ? 16 : 1;
  const size_t smem_limit = static_cast<size_t>(dev.max_smem_optin) - 1024;  // static scratch
  const size_t row_bytes = static_cast<size_t>(cols) * bytes_per_col;
  int cluster = 1;
  const size_t per_block = row_bytes > kCachedBytesPerBlock ? long_row_slice : kCachedBytesPerBlock;
  while (cluster < max_cluster && row_bytes > per_block * cluster) cluster *= 2;
  for (; cluster >= 1; cluster /= 2) {
    const int64_t slice = ceil_div<int64_t>(ceil_div<int64_t>(cols, cluster), pack) * pack;
    const size_t smem = static_cast<size_t>(slice) * bytes_per_col;
    if (smem > smem_limit) return false;
    const int64_t packs = slice / pack;
    CachedPlan best;
    for (const int threads : kCachedThreads) {
      if (threads != kCachedThreads[0] && packs > threads * kMaxPacksPerThread) break;
      const int64_t resident = resident_clusters(kernel, threads, smem, cluster, dev);
      if (resident > best.max_clusters) best = {resident, cluster, slice, threads, smem};
    }
    if (best.max_clusters > 0) {
      *plan = best;
      return true;
    }
  }
  return false;
}

// plan_cached, remembered per (kernel, device, row shape): a plan costs several occupancy
// queries, which would otherwise run on every call.
template <class Kernel>
bool remembered_plan(Kernel kernel, int64_t cols, int pack, size_t bytes_per_col, const DeviceInfo& dev,
                     CachedPlan* plan, size_t long_row_slice = kCachedBytesPerBlock) {
  struct Entry {
    const void* kernel;
    int device;
    int64_t cols;
    size_t bytes_per_col;
    CachedPlan plan;
  };
  static std::mutex mutex;
  static std::vector<Entry> memo;
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : memo) {
      if (e.kernel == key && e.device == dev.device && e.cols == cols && e.bytes_per_col == bytes_per_col) {
        *plan = e.plan;
        return true;
      }
    }
  }
  // Failures are not remembered: they send the row to the uncached path, whose rows are so
  // long that the queries' cost does not show.
  if (!plan_cached(kernel, cols, pack, bytes_per_col, long_row_slice, dev, plan)) return false;
  std::lock_guard<std::mutex> lock(mutex);
  if (memo.size() >= 256) memo.erase(memo.begin());
  memo.push_back({key, dev.device, cols, bytes_per_col, *plan});
  return true;
}

// Whether a plan runs the persistent grid (rather than one block per row; see unmasked_cached_grid).
bool persistent_plan(const CachedPlan& plan) { return plan.cluster > 1 || plan.smem > kCachedBytesPerBlock; }

// A persistent grid: every resident cluster loops over rows, so cluster scheduling is paid once
// and each block requests its next row while writing the current one (forward, 16-byte packs).
// Long rows (a cluster, or more than one block's cache budget) need that refill: one cluster per
// row measured 3-7 % slower at 128K-256K columns (session 5).
int64_t cached_grid(int64_t rows, const CachedPlan& plan) {
  return std::min<int64_t>(rows, plan.max_clusters) * plan.cluster;
}

// The unmaskable forward's grid. Rows within one block's cache budget get one block per row
// (the row loop runs once, so nothing is prefetched): the hardware refills each SM's block slots
// as rows finish, which measured 5-10 % faster than the persistent grid with refill at
// 1025-8192 columns (session 5; the persistent grid's blocks finish their last rows unevenly,
// and each block's row loop serializes its rows' latencies).
int64_t unmasked_cached_grid(int64_t rows, const CachedPlan& plan) {
  if (!persistent_plan(plan)) return std::min<int64_t>(rows, INT32_MAX);
  return cached_grid(rows, plan);
}

// L2 the lean backward may fill with its blocks' next rows (see l2_prefetch_bytes).
constexpr size_t kL2PrefetchBudget = size_t(16) << 20;

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
unsigned l2_prefetch_bytes(const CachedPlan& plan, const DeviceInfo& dev, int arrays, size_t elem_bytes) {
  const int64_t blocks = plan.max_clusters * plan.cluster;
  if (dev.cc_major < 9 || !persistent_plan(plan) || blocks <= 0 || blocks > dev.sm_count) return 0;
  const size_t slice_bytes = size_t(plan.slice) * elem_bytes;
  const size_t share = kL2PrefetchBudget / size_t(blocks) / arrays / 16 * 16;
  return unsigned(std::min(share, slice_bytes));
}

int64_t uncached_grid(int64_t rows, const DeviceInfo& dev) {
  return std::min<int64_t>(rows, int64_t(dev.sm_count) * 2);
}

template <class T, int P>
cudaError_t forward_packed(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log,
                           cudaStream_t stream, const DeviceInfo& dev) {
  if (cols <= kWarpMaxCols) {
    return with_warp_shape<P, 2>(cols, [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      return cuda::launch_kernel(forward_warp<T, P, W, K>, forward_warp_grid(rows, W), kWarpBlockThreads, 0, stream, x,
          mask, y, rows, cols, log);
    });
  }
  CachedPlan plan;
  if constexpr (kAsyncPack<T, P> && sizeof(T) <= 4) {  // float64's lean kernel spills (its log)
    if (mask == nullptr) {
      if (remembered_plan(forward_cached<T, P, false, false>, cols, P, sizeof(T), dev, &plan, kForwardLongSliceBytes)) {
        // Only rows long enough for a large cluster look up the pair kernel's own plan.
        CachedPlan pair;
        if (plan.cluster >= kPairStatsMinCluster &&
            remembered_plan(forward_cached<T, P, false, true>, cols, P, sizeof(T), dev, &pair, kForwardLongSliceBytes) &&
            pair.cluster >= kPairStatsMinCluster) {
          return launch_clustered(forward_cached<T, P, false, true>, unmasked_cached_grid(rows, pair), pair.threads,
                                  pair.smem, pair.cluster, stream, x, mask, y, rows, cols, pair.slice, log);
        }
        return launch_clustered(forward_cached<T, P, false, false>, unmasked_cached_grid(rows, plan), plan.threads,
                                plan.smem, plan.cluster, stream, x, mask, y, rows, cols, plan.slice, log);
      }
    }
  }
  if (remembered_plan(forward_cached<T, P, true, false>, cols, P, sizeof(T), dev, &plan)) {
    return launch_clustered(forward_cached<T, P, true, false>, cached_grid(rows, plan), plan.threads, plan.smem,
                            plan.cluster, stream, x, mask, y, rows, cols, plan.slice, log);
  }
  return cuda::launch_kernel(forward_uncached<T, P>, uncached_grid(rows, dev), 1024, 0, stream, x, mask, y, rows, cols,
      log);
}

template <class T, int P>
cudaError_t backward_packed(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                            bool log, cudaStream_t stream, const DeviceInfo& dev) {
  if (cols <= kWarpMaxCols) {
    return with_warp_shape<P, 1>(cols, [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      return cuda::launch_kernel(backward_warp<T, P, W, K>, warp_grid(rows, W, dev), kWarpBlockThreads, 0, stream, y,
          dy, mask, dx, rows, cols, log);
    });
  }
  CachedPlan plan;
  // Unmasked 16-byte packs on a persistent plan: the lean kernel. Rows within one block's cache
  // budget keep the register-staged kernel below (0.92-0.97 of the 3-pass bound in session 5).
  if constexpr (kAsyncPack<T, P> && sizeof(T) <= 4) {
    if (mask == nullptr && remembered_plan(backward_cached_lean<T, P>, cols, P, 2 * sizeof(T), dev, &plan) &&
        persistent_plan(plan)) {
      return launch_clustered(backward_cached_lean<T, P>, cached_grid(rows, plan), plan.threads, plan.smem,
                              plan.cluster, stream, y, dy, dx, rows, cols, plan.slice,
                              l2_prefetch_bytes(plan, dev, 2, sizeof(T)), log);
    }
  }
  if (remembered_plan(backward_cached<T, P>, cols, P, 2 * sizeof(T), dev, &plan)) {
    return launch_clustered(backward_cached<T, P>, cached_grid(rows, plan), plan.threads, plan.smem,
                            plan.cluster, stream, y, dy, mask, dx, rows, cols, plan.slice, log);
  }
  return cuda::launch_kernel(backward_uncached<T, P>, uncached_grid(rows, dev), 1024, 0, stream, y, dy, mask, dx, rows,
      cols, log);
}

// 16-byte packs when the row length and pointers allow, else single elements.
template <class T>
bool use_wide_pack(int64_t cols, const void* a, const void* b, const void* c, const void* mask) {
  constexpr int kWide = 16 / sizeof(T);
  const void* ptrs[] = {a, b, c};
  if (pack_size_for<T>(cols, ptrs, c ? 3 : 2) != kWide) return false;
  return mask == nullptr || reinterpret_cast<uintptr_t>(mask) % kWide == 0;
}

}  // namespace

cudaError_t forward_cuda(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows, int64_t cols,
                         bool log, cudaStream_t stream) {
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int kWide = 16 / sizeof(T);
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    if (use_wide_pack<T>(cols, x, y, nullptr, mask))
      return forward_packed<T, kWide>(xt, mask, yt, rows, cols, log, stream, dev);
    return forward_packed<T, 1>(xt, mask, yt, rows, cols, log, stream, dev);
  });
  return cudaSuccess;
}

cudaError_t backward_cuda(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx, int64_t rows,
                          int64_t cols, bool log, cudaStream_t stream) {
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int kWide = 16 / sizeof(T);
    const T* yt = static_cast<const T*>(y);
    const T* gt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    if (use_wide_pack<T>(cols, y, dy, dx, mask))
      return backward_packed<T, kWide>(yt, gt, mask, dxt, rows, cols, log, stream, dev);
    return backward_packed<T, 1>(yt, gt, mask, dxt, rows, cols, log, stream, dev);
  });
  return cudaSuccess;
}

}  // namespace jaxops::softmax
