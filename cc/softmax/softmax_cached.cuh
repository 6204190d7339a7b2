// Softmax cached path: a block, or a thread-block cluster, caches its slice of each row in shared
// memory (forward and backward kernels; the host plans are in softmax_forward.cu / softmax_backward.cu).
#pragma once
#include <cstdint>

#include <cuda_pipeline.h>

#include "common/cluster.cuh"
#include "softmax/softmax_common.cuh"
#include "softmax/softmax_window.cuh"

namespace jaxops::softmax {

// Cached path: the cluster's blocks split each row into slices of `slice` columns; each thread
// only ever touches its own packs of the shared-memory cache, so the cache needs no barriers.

// 16-byte packs can be copied global -> shared asynchronously (cp.async, sm_80+).
template <class T, int P>
constexpr bool kAsyncPack = sizeof(Pack<T, P>) == 16;

// Requests this thread's packs of a slice into the cache, asynchronously: the whole slice is in
// flight at once and holds no registers. Values come in 16-byte packs; a mask's packs of P flags
// are 4 or 8 bytes, which cp.async copies as well.
template <class T, int P>
__device__ __forceinline__ void request_slice_async(const T* __restrict__ src, T* cache, unsigned npacks) {
  static_assert(sizeof(Pack<T, P>) == 16 || sizeof(Pack<T, P>) == 8 || sizeof(Pack<T, P>) == 4,
                "cp.async copies 4, 8 or 16 bytes");
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

// max_of_requested for a masked row whose mask slice was requested into `mask_cache` with it:
// marks this thread's masked entries -inf in the cache and returns the max of the rest.
template <class T, int P>
__device__ __forceinline__ acc_t<T> mask_requested(T* cache, const bool* mask_cache, unsigned npacks) {
  using A = acc_t<T>;
  const T ninf = from_acc<T>(neg_inf<A>());
  __pipeline_wait_prior(0);
  A m = neg_inf<A>();
#pragma unroll 4
  for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x) {
    const Pack<bool, P> mk = load_pack<bool, P>(mask_cache + i * P);
    Pack<T, P> pk = load_pack<T, P>(cache + i * P);
    bool any = false;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (!mk.v[p]) {
        pk.v[p] = ninf;
        any = true;
      }
    }
    if (any) store_pack<T, P>(cache + i * P, pk);
    m = pack_max<T, P>(m, pk);
  }
  return m;
}

// Through registers (pack widths cp.async cannot copy), kUnroll loads in flight a thread; masked
// entries are cached as -inf.
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

// kMaskable = false compiles the unmasked kernel alone (mask_arg is ignored): without the mask
// reads it needs fewer registers, so more blocks (rows) fit an SM where shared memory allows.
// 16-byte packs are copied into the cache by cp.async, masked or not: a masked row's mask slice
// follows the values' slice in shared memory (one byte a column, prefetched with them), and its
// masked entries are then marked -inf in the cache (mask_requested). Other pack widths are staged
// through registers (cache_slice, maskable kernel only), the mask read from global memory.
// kPairStats: each thread sums exp over its own packs at its own max, and one (max, sum) reduction
// (MaxSumOp) gives the row's statistics, so the blocks of a cluster meet once a row; otherwise the
// row max is reduced first, then the sum of exp at that max (two block and cluster reductions),
// and softmax's output pass scales the exp cached by the sum pass instead of recomputing it.
// Which one wins depends on the cluster size (kPairStatsMinCluster).
// kWindow (16-byte packs only): rows that are not whole packs; the blocks split each row's aligned
// window (softmax_window.cuh) into slices of `slice` window columns, so a block's pack count
// varies by one from row to row.
//
// The cache is aligned to 128 bytes, and every extern __shared__ declaration in this file must say
// so (nvcc keeps one alignment for the shared symbol): the dynamic region starts after the static
// shared memory, and when that left it 16 bytes off a 32-byte boundary (304 bytes of statics,
// session 12) every cached forward ran ~10 % slower (H100, f32 16384x4096 179.6 -> 198.6 us),
// the cp.async fills landing across shared-memory sectors.
template <class T, int P, bool kMaskable, bool kPairStats, bool kWindow = false>
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
  // float64's packs of 2 flags are too small for cp.async: its masked rows take cache_slice.
  constexpr bool kMaskCache = kMaskable && kAsyncPack<T, P> && P >= 4;
  bool* const mask_cache = reinterpret_cast<bool*>(cache + slice);  // kMaskCache only
  __shared__ Stat scratch[33];
  __shared__ Stat slots[2], bcast[2];
  const unsigned nblocks = cluster_blocks(), rank = cluster_rank();
  const int64_t begin = int64_t(rank) * slice;
  // A slice fits one block's shared memory, so the cache loops index packs in 32 bits, unsigned:
  // a global address is then one IMAD.WIDE.U32 off the row base (no sign extension per pack).
  const unsigned row_packs = begin < cols ? unsigned((std::min(cols, begin + slice) - begin) / P) : 0;
  const int64_t total = rows * cols;
  const T ninf = from_acc<T>(neg_inf<A>());
  // 16-byte packs in a persistent grid (long rows; see async_cached_grid): each
  // thread requests its packs of the block's next row right after writing its output for them
  // (it owns those cache entries, so no barrier), so the next row's loads are in flight during
  // this row's output pass. Without it all blocks of the persistent grid load, reduce and write
  // in step, and DRAM idles while they all reduce. With one block per row it never fires.
  const bool async = kAsyncPack<T, P> && (kMaskCache || mask == nullptr);
  const int64_t stride = gridDim.x / nblocks;
  bool requested = false;  // this row's packs already requested during the previous row
  [[maybe_unused]] int parity = 0;  // kPairStats: one cluster reduction a row, alternating slots
  for (int64_t row = blockIdx.x / nblocks; row < rows; row += stride) {
    const int64_t off = row * cols + begin;
    [[maybe_unused]] const RowWindow<P> w(row, cols);
    const unsigned npacks = kWindow ? slice_packs<P>(w, begin / P, slice / P) : row_packs;
    A m;
    if constexpr (kWindow) {
      static_assert(!kMaskable || kMaskCache, "windows are read by cp.async");
      if (!requested) {
        request_window_slice<T, P>(cache, x, w, begin / P, npacks, total);
        if (mask) request_window_slice<bool, P>(mask_cache, mask, w, begin / P, npacks, total);
      }
      __pipeline_wait_prior(0);
      // Other rows' flags in the edge packs need no fill: their entries already hold -inf.
      fill_cached_edges<T, P>(cache, w, begin / P, npacks, ninf);
      // Both wait for nothing more.
      m = mask ? mask_requested<T, P>(cache, mask_cache, npacks) : max_of_requested<T, P>(cache, npacks);
    } else if constexpr (kAsyncPack<T, P>) {
      if (async) {
        if (!requested) {
          request_slice_async<T, P>(x + off, cache, npacks);
          if constexpr (kMaskCache) {
            if (mask) request_slice_async<bool, P>(mask + off, mask_cache, npacks);
          }
        }
        m = kMaskCache && mask ? mask_requested<T, P>(cache, mask_cache, npacks)
                               : max_of_requested<T, P>(cache, npacks);
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
    const bool* next_mask = prefetch && mask ? mask + (row + stride) * cols + begin : mask;
    T* const out = y + off;  // pack addresses: one IMAD.WIDE.U32 off this base
    [[maybe_unused]] const RowWindow<P> next_w(row + stride, cols);
    [[maybe_unused]] const unsigned next_packs = kWindow && prefetch ? slice_packs<P>(next_w, begin / P, slice / P) : 0;
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
          // Uncached flags: register-staged rows, whole packs (windows are read by cp.async).
          const Pack<bool, P> mk =
              kMaskCache ? load_pack<bool, P>(mask_cache + i * P) : load_pack<bool, P>(mask + off + i * P);
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (!mk.v[p]) v[p] = masked_out<A>(kLog);
        }
        // The entries were read above by this thread alone: they may now be overwritten.
        if constexpr (kWindow) {
          store_window_pack<T, P>(y, w, begin / P + i, repack<T, P>(v));
          if (i < next_packs) {
            const int64_t g = next_w.base + begin + int64_t(i) * P;
            request_window_pack<T, P>(cache + i * P, x, g, total);
            if constexpr (kMaskCache) {
              if (mask) request_window_pack<bool, P>(mask_cache + i * P, mask, g, total);
            }
          }
        } else {
          store_pack<T, P>(out + i * P, repack<T, P>(v));
          if constexpr (kAsyncPack<T, P>) {
            if (prefetch) {
              __pipeline_memcpy_async(cache + i * P, next + i * P, sizeof(Pack<T, P>));
              if constexpr (kMaskCache) {
                if (mask) __pipeline_memcpy_async(mask_cache + i * P, next_mask + i * P, sizeof(Pack<bool, P>));
              }
            }
          }
        }
      }
      // The next row's window may hold one pack more than this row's in this slice (windows differ
      // by at most one); entry i stays thread i % blockDim.x's.
      if constexpr (kWindow) {
        if (next_packs > npacks && npacks % blockDim.x == threadIdx.x) {
          const int64_t g = next_w.base + begin + int64_t(npacks) * P;
          request_window_pack<T, P>(cache + npacks * P, x, g, total);
          if constexpr (kMaskCache) {
            if (mask) request_window_pack<bool, P>(mask_cache + npacks * P, mask, g, total);
          }
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
      if (mask) {  // masked entries get no gradient, as in jax.nn (also in NaN rows)
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

// The cp.async backward for 16-byte packs on a persistent grid (long rows, clusters), built like
// the lean forward: each thread requests its packs of y and dy by cp.async (the whole slice in
// flight, no registers held), sums from the cache, and after writing its dx pack i requests
// pack i of the block's next row into the same two entries (it alone reads and writes them, so
// no barrier). With prefetch_bytes > 0 (one block per SM only, see l2_prefetch_bytes) L2 also
// fetches the head of the next row (prefetch_bytes per array) from the moment this row has
// arrived, so DRAM keeps working while every block of the grid reduces. Session 6 (H100, without
// the prefetch): bf16 backward 153 -> 142 us, float32 at several blocks per SM within 1-3 %.
// Session 5: the register-staged kernel above loaded, reduced and wrote in step at one block per
// SM (f32 256x262144: 0.79 of the 3-pass bound) and was issue-heavy for bf16 (0.87).
// kWindow: rows that are not whole packs, split like forward_cached's windows. kMaskable: the
// mask's slice follows dy's in shared memory (requested with it); it excludes masked dy from the
// sum and zeroes their dx. False compiles it out (mask_arg is ignored).
template <class T, int P, bool kWindow = false, bool kMaskable = false>
__global__ void __launch_bounds__(1024)
backward_cached_lean(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask_arg,
                     T* __restrict__ dx, int64_t rows, int64_t cols, int64_t slice, unsigned prefetch_bytes,
                     bool log) {
  cuda::enter_kernel();
  static_assert(kAsyncPack<T, P>, "the lean backward copies 16-byte packs");
  static_assert(!kMaskable || P >= 4, "cp.async copies the mask's packs of P flags: 4 bytes or more");
  using A = acc_t<T>;
  const bool* const mask = kMaskable ? mask_arg : nullptr;
  extern __shared__ __align__(128) unsigned char smem[];
  T* cache_y = reinterpret_cast<T*>(smem);
  T* cache_g = cache_y + slice;
  bool* const mask_cache = reinterpret_cast<bool*>(cache_g + slice);  // kMaskable only
  __shared__ A scratch[33];
  __shared__ A slots[2], bcast[2];
  const unsigned nblocks = cluster_blocks(), rank = cluster_rank();
  const int64_t begin = int64_t(rank) * slice;
  const unsigned row_packs = begin < cols ? unsigned((std::min(cols, begin + slice) - begin) / P) : 0;
  const unsigned l2_bytes = std::min<unsigned>(prefetch_bytes, row_packs * unsigned(sizeof(Pack<T, P>)));
  const int64_t total = rows * cols;
  const T zero = from_acc<T>(A(0));
  const int64_t stride = gridDim.x / nblocks;
  bool requested = false;  // this row's packs already requested during the previous row
  int parity = 0;          // one cluster reduction a row: alternate its slots
  for (int64_t row = blockIdx.x / nblocks; row < rows; row += stride, parity ^= 1) {
    const int64_t off = row * cols + begin;
    [[maybe_unused]] const RowWindow<P> w(row, cols);
    const unsigned npacks = kWindow ? slice_packs<P>(w, begin / P, slice / P) : row_packs;
    if (!requested) {
      if constexpr (kWindow) {
        request_window_slice<T, P>(cache_y, y, w, begin / P, npacks, total);
        request_window_slice<T, P>(cache_g, dy, w, begin / P, npacks, total);
        if (mask) request_window_slice<bool, P>(mask_cache, mask, w, begin / P, npacks, total);
      } else {
        request_slice_async<T, P>(y + off, cache_y, npacks);
        request_slice_async<T, P>(dy + off, cache_g, npacks);
        if (mask) request_slice_async<bool, P>(mask + off, mask_cache, npacks);
      }
    }
    __pipeline_wait_prior(0);
    if constexpr (kWindow) {  // other rows' y and dy count as 0 (NaN there would not)
      fill_cached_edges<T, P>(cache_y, w, begin / P, npacks, zero);
      fill_cached_edges<T, P>(cache_g, w, begin / P, npacks, zero);
    }
    const bool has_next = row + stride < rows;
    [[maybe_unused]] const RowWindow<P> next_w(row + stride, cols);
    const int64_t next_off = kWindow ? next_w.base + begin : off + stride * cols;
    [[maybe_unused]] const unsigned next_packs = kWindow && has_next ? slice_packs<P>(next_w, begin / P, slice / P) : 0;
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
      if (mask) {  // masked dy takes no part, even where it is NaN (masked y is 0 or -inf)
        const Pack<bool, P> mk = load_pack<bool, P>(mask_cache + i * P);
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (!mk.v[p]) yv[p] = gv[p] = 0;
      }
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
        if (mask) {  // masked entries get no gradient, as in jax.nn (also in NaN rows)
          const Pack<bool, P> mk = load_pack<bool, P>(mask_cache + i * P);
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (!mk.v[p]) yv[p] = 0;
        }
        // Both entries were read above by this thread alone: they may now be overwritten.
        if constexpr (kWindow) {
          store_window_pack<T, P>(dx, w, begin / P + i, repack<T, P>(yv));
          if (i < next_packs) {
            request_window_pack<T, P>(cache_y + i * P, y, next_off + int64_t(i) * P, total);
            request_window_pack<T, P>(cache_g + i * P, dy, next_off + int64_t(i) * P, total);
            if (mask) request_window_pack<bool, P>(mask_cache + i * P, mask, next_off + int64_t(i) * P, total);
          }
        } else {
          store_pack<T, P>(out + i * P, repack<T, P>(yv));
          if (has_next) {
            __pipeline_memcpy_async(cache_y + i * P, next_y + i * P, sizeof(Pack<T, P>));
            __pipeline_memcpy_async(cache_g + i * P, next_g + i * P, sizeof(Pack<T, P>));
            if (mask) __pipeline_memcpy_async(mask_cache + i * P, mask + next_off + i * P, sizeof(Pack<bool, P>));
          }
        }
      }
      // As in forward_cached: the next row's window may hold one pack more in this slice.
      if constexpr (kWindow) {
        if (next_packs > npacks && npacks % blockDim.x == threadIdx.x) {
          request_window_pack<T, P>(cache_y + npacks * P, y, next_off + int64_t(npacks) * P, total);
          request_window_pack<T, P>(cache_g + npacks * P, dy, next_off + int64_t(npacks) * P, total);
          if (mask) request_window_pack<bool, P>(mask_cache + npacks * P, mask, next_off + int64_t(npacks) * P, total);
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

}  // namespace jaxops::softmax
