// layer_norm / rms_norm backward kernels: dx by team, warp, block and row-group kernels, with the
// per-slot parameter-gradient partials and their fixed-order reduction (reduce_slots).
#pragma once
#include <cuda_pipeline.h>

#include "layer_norm/layer_norm_kernels.cuh"
#include "layer_norm/layer_norm_split.cuh"

namespace jaxops::layer_norm {

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale (rms: no mean(g)).

template <class T>
__device__ __forceinline__ acc_t<T>* slot_ptr(const BackwardArgs& a, int64_t g, int64_t j) {
  const int64_t per_slot = num_acc(a.shape.rms) * a.shape.cols;
  return static_cast<acc_t<T>*>(a.workspace) + (g * a.slots_per_group + j) * per_slot;
}

// Launched in clusters of n blocks (Hopper; one group, one slot per block, see
// launch_slotted), the n blocks of a cluster add their column sums through distributed shared
// memory and write one partial row per cluster, slot blockIdx.x / n: the workspace traffic (written at
// the kernel's end, when nothing else overlaps it) and reduce_slots' reads shrink n-fold. Blocks
// are added in rank order, so the sums stay bit-reproducible. `sums`: this block's [nacc][cols]
// sums in shared memory, 16-byte aligned, cols a multiple of 16 / sizeof(A). Every thread of
// every block of the cluster must call it; it returns true when it wrote the slot (n > 1).
template <class T, class A>
__device__ __forceinline__ bool store_cluster_sums(const BackwardArgs& a, A* sums) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Read here, not hoisted into the prologue (cooperative_groups' num_blocks() was, costing a
  // register the 80-register row kernels spilled).
  unsigned n, rank;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  if (n == 1) return false;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  auto cluster = cooperative_groups::this_cluster();
  constexpr int kChunk = 16 / static_cast<int>(sizeof(A));
  const int64_t chunks = num_acc(a.shape.rms) * a.shape.cols / kChunk;
  cluster.sync();  // every block's sums are final and visible to the cluster
  A* out = slot_ptr<T>(a, 0, blockIdx.x / n);
  for (int64_t q = int64_t(rank) * blockDim.x + threadIdx.x; q < chunks;
       q += int64_t(n) * blockDim.x) {
    Pack<A, kChunk> total = load_pack<A, kChunk>(cluster.map_shared_rank(sums, 0) + q * kChunk);
    for (unsigned r = 1; r < n; ++r) {
      const Pack<A, kChunk> v = load_pack<A, kChunk>(cluster.map_shared_rank(sums, r) + q * kChunk);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) total.v[e] += v.v[e];
    }
    store_pack(out + q * kChunk, total);
  }
  cluster.sync();  // peers may still be reading this block's sums
  return true;
#else
  return false;
#endif
}

// g = dy * scale rounded once, the same value in the row sums and in dx. A plain `d * s - mg`
// is contracted by nvcc into fma(d, s, -mg), which subtracts the rounded mean(g) from the
// *unrounded* product: with one column (g == mean(g), xhat == 0) dx came out as the product's
// rounding error times rstd (~1e-5 for rstd = 1/sqrt(eps)) instead of exactly 0, and in
// general the row sums and dx disagreed by one rounding. The CPU twin rounds g the same way.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// Per-row sums of g and g * xhat over one pack.
template <class T, int kPack>
__device__ __forceinline__ void pack_sums(const Pack<T, kPack>& xp, const Pack<T, kPack>& dp,
                                          const Pack<T, kPack>& sp, acc_t<T> mean, acc_t<T> rstd,
                                          acc_t<T>& sum_g, acc_t<T>& sum_gx) {
  using A = acc_t<T>;
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const A xhat = (to_acc(xp.v[e]) - mean) * rstd;
    const A gv = mul_rn(to_acc(dp.v[e]), to_acc(sp.v[e]));
    sum_g += gv;
    sum_gx += gv * xhat;
  }
}

// dx for one pack; adds dy * xhat (and dy) into acc_scale / acc_bias.
template <class T, int kPack>
__device__ __forceinline__ Pack<T, kPack> pack_dx(const Pack<T, kPack>& xp, const Pack<T, kPack>& dp,
                                                  const Pack<T, kPack>& sp, acc_t<T> mean, acc_t<T> rstd,
                                                  acc_t<T> mg, acc_t<T> mgx, acc_t<T>* acc_scale,
                                                  acc_t<T>* acc_bias) {
  using A = acc_t<T>;
  Pack<T, kPack> out;
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const A xhat = (to_acc(xp.v[e]) - mean) * rstd;
    const A d = to_acc(dp.v[e]);
    out.v[e] = from_acc<T>(rstd * ((mul_rn(d, to_acc(sp.v[e])) - mg) - xhat * mgx));
    acc_scale[e] += d * xhat;
    if (acc_bias) acc_bias[e] += d;
  }
  return out;
}

template <class T>
__device__ __forceinline__ void row_stats(const BackwardArgs& a, int64_t row, acc_t<T>& mean, acc_t<T>& rstd) {
  mean = a.mean ? static_cast<const acc_t<T>*>(a.mean)[row] : acc_t<T>(0);
  rstd = static_cast<const acc_t<T>*>(a.rstd)[row];
}

// The end of a team kernel's slot: the teams of each warp combined (lanes l, l + kWidth, ... own
// the same columns), then the warps in order into buf (nacc x cols values of shared memory), then
// buf written as the slot's partial row. with_bias: the dbias sums too (false for rms_norm, whose
// acc_b is unused). The caller synchronizes before buf is rewritten.
template <class T, class A, int kPack, int kPacks, int kWidth>
__device__ __forceinline__ void store_team_sums(const BackwardArgs& a, int64_t g, int64_t j, bool with_bias,
                                                A (&acc_s)[kPacks][kPack], A (&acc_b)[kPacks][kPack], A* buf) {
  const int cols = static_cast<int>(a.shape.cols), npacks = cols / kPack;
  const int lane = threadIdx.x % kWidth, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int e = 0; e < kPack; ++e)
#pragma unroll
      for (int offset = kWidth; offset < 32; offset *= 2) {
        acc_s[k][e] += __shfl_xor_sync(0xffffffffu, acc_s[k][e], offset);
        if (with_bias) acc_b[k][e] += __shfl_xor_sync(0xffffffffu, acc_b[k][e], offset);
      }
  for (int w = 0; w < nwarps; ++w) {
    if (warp == w && threadIdx.x % 32 < kWidth) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * kWidth;
        if (p < npacks) {
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            const int c = p * kPack + e;
            buf[c] = (w == 0 ? A(0) : buf[c]) + acc_s[k][e];
            if (with_bias) buf[cols + c] = (w == 0 ? A(0) : buf[cols + c]) + acc_b[k][e];
          }
        }
      }
    }
    __syncthreads();
  }
  A* out = slot_ptr<T>(a, g, j);
  const int n = (with_bias ? 2 : 1) * cols;
  for (int c = threadIdx.x; c < n; c += blockDim.x) out[c] = buf[c];
}

// Teams of kWidth lanes per row, row and column accumulators in registers. At the end of a slot
// the teams' accumulators are combined (shuffles inside a warp, then warps in order through
// shared memory: nacc * cols values) and written as the slot's partial row.
template <class T, int kPack, int kPacks, int kWidth>
__global__ void __launch_bounds__(256) backward_team(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* buf = reinterpret_cast<A*>(smem_raw);  // nacc * cols
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int teams = blockDim.x / kWidth, team = threadIdx.x / kWidth, lane = threadIdx.x % kWidth;
  const int64_t npacks = s.cols / kPack;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    A acc_s[kPacks][kPack], acc_b[kPacks][kPack];
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kPack; ++e) acc_s[k][e] = acc_b[k][e] = A(0);

    for (int64_t base = begin; base < end; base += teams) {
      const int64_t row = base + team;
      const bool valid_row = row < end;
      A mean = 0, rstd = 0;
      if (valid_row) row_stats<T>(a, row, mean, rstd);
      // scale is re-read (an L1 hit) rather than kept: registers bound how many rows are in flight.
      Pack<T, kPack> xp[kPacks], dp[kPacks];
      A sum_g = 0, sum_gx = 0;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * kWidth;
        if (valid_row && p < npacks) {
          xp[k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
          dp[k] = load_pack<T, kPack>(dy + row * s.cols + p * kPack);
          pack_sums<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, sum_g, sum_gx);
        }
      }
      const A mg = s.rms ? A(0) : team_sum<kWidth>(sum_g) / A(s.cols);
      const A mgx = team_sum<kWidth>(sum_gx) / A(s.cols);
      if (!valid_row) continue;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * kWidth;
        if (p < npacks)
          store_pack(dx + row * s.cols + p * kPack,
                     pack_dx<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, mg,
                                       mgx, acc_s[k], acc_b[k]));
      }
    }
    store_team_sums<T, A, kPack, kPacks, kWidth>(a, g, j, nacc == 2, acc_s, acc_b, buf);
    __syncthreads();  // buf is rewritten by the next slot
  }
}

// Full-warp teams with at least 16 columns per lane keep their column accumulators in shared
// memory instead of registers (backward_warp): with 32 columns per lane, register accumulators
// (2 x 32 per lane) took backward_team to 186-196 registers, one 256-thread block per SM and too
// few loads in flight for DRAM (44-54% busy).
JAXOPS_LN_HD constexpr bool warp_acc_in_smem(int pack, int packs) { return pack * packs >= 16; }

// Layout of backward_warp's accumulators: each warp owns a private slice of nacc x (32 lanes x
// kPacks x kPack) values, each lane only ever touching its own columns (so the row loop needs no
// barrier), stored as 16-byte chunks with lanes adjacent: conflict-free 16-byte shared accesses.
// For float the position of column c is c itself.
template <class A, int kPack, int kPacks>
struct WarpAccLayout {
  static constexpr int kChunk = (16 / static_cast<int>(sizeof(A))) < kPack ? 16 / static_cast<int>(sizeof(A)) : kPack;
  static constexpr int kChunks = kPack / kChunk;  // chunks per pack
  static constexpr int kSlice = 32 * kPacks * kPack;  // values per accumulator per warp
  // Offset of element e of the lane's k-th pack inside one accumulator's slice.
  __device__ static int offset(int lane, int k, int e) {
    return ((k * kChunks + e / kChunk) * 32 + lane) * kChunk + e % kChunk;
  }
  // Offset of column c (pack c / kPack = k * 32 + lane) inside one accumulator's slice.
  __device__ static int column(int64_t c) {
    const int p = static_cast<int>(c / kPack), e = static_cast<int>(c % kPack);
    return offset(p % 32, p / 32, e);
  }
  using Chunk = Pack<A, kChunk>;
  // The lane's positions in both slices (acc_b only when `two`: layer_norm's dbias) set to 0, all
  // kPacks packs of them (also past the row: the slot's column sums read them).
  __device__ static void zero(A* acc_s, A* acc_b, bool two, int lane) {
    const Chunk z{};
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int e = 0; e < kPack; e += kChunk) {
        store_pack(acc_s + offset(lane, k, e), z);
        if (two) store_pack(acc_b + offset(lane, k, e), z);
      }
  }
  // The lane's k-th pack of both slices into as / ab (ab 0 unless `two`).
  __device__ static void load(const A* acc_s, const A* acc_b, bool two, int lane, int k, A (&as)[kPack],
                              A (&ab)[kPack]) {
#pragma unroll
    for (int e = 0; e < kPack; e += kChunk) {
      const Chunk cs = load_pack<A, kChunk>(acc_s + offset(lane, k, e));
      Chunk cb{};
      if (two) cb = load_pack<A, kChunk>(acc_b + offset(lane, k, e));
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        as[e + i] = cs.v[i];
        ab[e + i] = cb.v[i];
      }
    }
  }
  // as / ab back into the lane's k-th pack of both slices (ab only when `two`).
  __device__ static void store(A* acc_s, A* acc_b, bool two, int lane, int k, const A (&as)[kPack],
                               const A (&ab)[kPack]) {
#pragma unroll
    for (int e = 0; e < kPack; e += kChunk) {
      Chunk cs, cb;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        cs.v[i] = as[e + i];
        cb.v[i] = ab[e + i];
      }
      store_pack(acc_s + offset(lane, k, e), cs);
      if (two) store_pack(acc_b + offset(lane, k, e), cb);
    }
  }
};

// Dynamic shared memory of backward_warp: nacc slices per warp.
template <class A, int kPack, int kPacks>
constexpr size_t warp_acc_smem(int threads, int nacc) {
  return static_cast<size_t>(threads / 32) * nacc * (32 * kPacks * kPack) * sizeof(A);
}

// A warp per row (rows begin + warp, + nwarps, ...), row in registers, column accumulators in the
// warp's shared-memory slice (see WarpAccLayout). At the end of a slot every thread adds a few
// columns over the warps' slices in warp order and writes the slot's partial row. kMinBlocks
// caps registers so that at least that many 256-thread blocks fit one SM.
template <class T, int kPack, int kPacks, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) backward_warp(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  using L = WarpAccLayout<A, kPack, kPacks>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const int64_t npacks = s.cols / kPack;
  A* slices = reinterpret_cast<A*>(smem_raw);  // [nwarps][nacc][kSlice]
  A* acc_s = slices + static_cast<int64_t>(warp) * nacc * L::kSlice;
  A* acc_b = acc_s + L::kSlice;  // only used when nacc == 2
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    L::zero(acc_s, acc_b, nacc == 2, lane);
    // The row is warp-uniform, so the shuffles below always see the whole warp.
    for (int64_t row = begin + warp; row < end; row += nwarps) {
      A mean, rstd;
      row_stats<T>(a, row, mean, rstd);
      Pack<T, kPack> xp[kPacks], dp[kPacks];
      A sum_g = 0, sum_gx = 0;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * 32;
        if (p < npacks) {
          xp[k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
          dp[k] = load_pack<T, kPack>(dy + row * s.cols + p * kPack);
        }
      }
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * 32;
        if (p < npacks)
          pack_sums<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, sum_g, sum_gx);
      }
      const A mg = s.rms ? A(0) : team_sum<32>(sum_g) / A(s.cols);
      const A mgx = team_sum<32>(sum_gx) / A(s.cols);
      // Keep x and dy live only in their storage type across the reductions: otherwise ptxas
      // keeps the float conversions of the first pass (bfloat16 at 1024 columns: 149 registers).
      // Also, the memory clobber makes the scale packs be re-read (an L1 hit), not kept.
      opaque_packs(xp);
      opaque_packs(dp);
      asm volatile("" ::: "memory");
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = lane + k * 32;
        if (p < npacks) {
          A as[kPack], ab[kPack];
          L::load(acc_s, acc_b, nacc == 2, lane, k, as, ab);
          store_pack(dx + row * s.cols + p * kPack,
                     pack_dx<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, mg, mgx,
                                       as, ab));  // rms_norm: ab is added to but never stored
          L::store(acc_s, acc_b, nacc == 2, lane, k, as, ab);
        }
      }
    }
    __syncthreads();  // every warp's slice is complete
    A* out = slot_ptr<T>(a, g, j);
    for (int64_t c = threadIdx.x; c < nacc * s.cols; c += blockDim.x) {
      const int which = static_cast<int>(c / s.cols);
      const int at = which * L::kSlice + L::column(c % s.cols);
      A total = 0;
      for (int w = 0; w < nwarps; ++w) total += slices[static_cast<int64_t>(w) * nacc * L::kSlice + at];
      out[c] = total;
    }
    __syncthreads();  // the slices are zeroed again by the next slot
  }
}

// One block per row. kCached: x and dy are cached in shared memory on the first pass and the
// column accumulators live there too; otherwise x and dy are re-read from global memory and
// the accumulators are the slot's workspace row itself. Each thread only touches the columns
// it owns (packs threadIdx.x + k * blockDim.x), so only the row reductions need barriers.
template <class T, int kPack, bool kCached>
__global__ void __launch_bounds__(1024) backward_block(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A scratch[64];
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int64_t npacks = s.cols / kPack;
  // Shared layout when cached: [nacc * cols accumulators][cols x][cols dy].
  A* smem_acc = reinterpret_cast<A*>(smem_raw);
  T* xc = reinterpret_cast<T*>(smem_raw + sizeof(A) * nacc * s.cols);
  T* dyc = xc + s.cols;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    A* out = slot_ptr<T>(a, g, j);
    A* acc = kCached ? smem_acc : out;
    for (int64_t p = threadIdx.x; p < npacks; p += blockDim.x)
      for (int e = 0; e < kPack; ++e) {
        acc[p * kPack + e] = A(0);
        if (nacc == 2) acc[s.cols + p * kPack + e] = A(0);
      }
    for (int64_t row = begin; row < end; ++row) {
      A mean, rstd;
      row_stats<T>(a, row, mean, rstd);
      A sum_g = 0, sum_gx = 0;
#pragma unroll(kPack > 1 && sizeof(T) < 8 ? 4 : 1)  // (double spilled)
      for (int64_t p = threadIdx.x; p < npacks; p += blockDim.x) {
        const auto xp = load_pack<T, kPack>(x + row * s.cols + p * kPack);
        const auto dp = load_pack<T, kPack>(dy + row * s.cols + p * kPack);
        if (kCached) {
          store_pack(xc + p * kPack, xp);
          store_pack(dyc + p * kPack, dp);
        }
        pack_sums<T, kPack>(xp, dp, load_pack<T, kPack>(scale + p * kPack), mean, rstd, sum_g, sum_gx);
      }
      block_sum2(sum_g, sum_gx, scratch);
      const A mg = s.rms ? A(0) : sum_g / A(s.cols), mgx = sum_gx / A(s.cols);
#pragma unroll(kPack > 1 && sizeof(T) < 8 ? 4 : 1)  // (double spilled)
      for (int64_t p = threadIdx.x; p < npacks; p += blockDim.x) {
        const T* xs = kCached ? xc : x + row * s.cols;
        const T* dys = kCached ? dyc : dy + row * s.cols;
        A as[kPack], ab[kPack];
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          as[e] = acc[p * kPack + e];
          ab[e] = nacc == 2 ? acc[s.cols + p * kPack + e] : A(0);
        }
        store_pack(dx + row * s.cols + p * kPack,
                   pack_dx<T, kPack>(load_pack<T, kPack>(xs + p * kPack), load_pack<T, kPack>(dys + p * kPack),
                                     load_pack<T, kPack>(scale + p * kPack), mean, rstd, mg, mgx, as, ab));
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          acc[p * kPack + e] = as[e];
          if (nacc == 2) acc[s.cols + p * kPack + e] = ab[e];
        }
      }
    }
    if (kCached) {
      for (int64_t p = threadIdx.x; p < npacks; p += blockDim.x)
        for (int e = 0; e < kPack; ++e) {
          out[p * kPack + e] = smem_acc[p * kPack + e];
          if (nacc == 2) out[s.cols + p * kPack + e] = smem_acc[s.cols + p * kPack + e];
        }
    }
  }
}

// f(k, p) for this thread's packs p = threadIdx.x + k * blockDim.x of a row (k < kPacks), those
// inside the row. Pack indices are 32-bit (npacks <= 512 * kPacks here): fewer 64-bit address
// registers.
template <int kPacks, class F>
__device__ __forceinline__ void for_thread_packs(int npacks, F&& f) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = threadIdx.x + k * blockDim.x;
    if (p < npacks) f(k, p);
  }
}

// Loads this thread's packs of one row of x and dy.
template <class T, int kPack, int kPacks>
__device__ __forceinline__ void load_row_packs(const T* x, const T* dy, int64_t row, int64_t cols, int npacks,
                                               Pack<T, kPack> (&xp)[kPacks], Pack<T, kPack> (&dp)[kPacks]) {
  const T* xr = x + row * cols;
  const T* dyr = dy + row * cols;
  for_thread_packs<kPacks>(npacks, [&](int k, int p) {
    xp[k] = load_pack<T, kPack>(xr + p * kPack);
    dp[k] = load_pack<T, kPack>(dyr + p * kPack);
  });
}

// A row's x and dy packs of this thread requested by cp.async into shared memory (xs / ds: the
// block's columns), and read back into registers after __pipeline_wait_prior. Each thread copies
// and reads only its own packs, so no barrier is needed.
template <class T, int kPack, int kPacks>
__device__ __forceinline__ void request_row_packs(T* xs, T* ds, const T* x, const T* dy, int64_t row, int64_t cols,
                                                  int npacks) {
  const T* xr = x + row * cols;
  const T* dyr = dy + row * cols;
  for_thread_packs<kPacks>(npacks, [&](int, int p) {
    __pipeline_memcpy_async(xs + p * kPack, xr + p * kPack, 16);
    __pipeline_memcpy_async(ds + p * kPack, dyr + p * kPack, 16);
  });
  __pipeline_commit();
}

template <class T, int kPack, int kPacks>
__device__ __forceinline__ void staged_row_packs(const T* xs, const T* ds, int npacks, Pack<T, kPack> (&xp)[kPacks],
                                                 Pack<T, kPack> (&dp)[kPacks]) {
  __pipeline_wait_prior(0);
  for_thread_packs<kPacks>(npacks, [&](int k, int p) {
    xp[k] = load_pack<T, kPack>(xs + p * kPack);
    dp[k] = load_pack<T, kPack>(ds + p * kPack);
  });
}

// One block per row for float rows of up to kPacks * 512 16-byte packs (2048-8192 columns),
// session 4. backward_block caches x and dy in shared memory and walks its rows strictly load ->
// reduce -> write; with the workspace's 264 slots capping the grid at 2 blocks per SM, a block had
// one row's loads in flight only during the load phase (bfloat16 4096 columns: 16 KB per block,
// ~1/4 of the row time), so the backward ran at the same per-row time as float32, i.e. half its
// bandwidth. Here x and dy stay in registers (kPacks packs a thread); the next row is loaded after
// the current row's dx is written. (A variant that loaded the next row's x, dy, mean and rstd
// before the current row's reductions measured 2-4 % slower on the H100, session 4, and was
// removed.) The column accumulators of the thread's own columns live in dynamic shared memory
// (nacc x cols, 16-byte chunks with threads adjacent, no barrier: each thread only touches its
// own columns): register accumulators took > 128 registers with the prefetch. 16-bit types take
// backward_rows_lean (session 5); the register-accumulator branch for them was removed (session 6).
// kSplit (session 32): the row's packs are split over the blocks of a cluster
// (layer_norm_split.cuh); this block sees only its own `cols` columns, from `first` on.
// kAsync (session 41; unsplit only): the next row's x and dy come by cp.async into shared memory
// behind the column sums ([2][cols] of T) while this row is reduced and written. Without it the
// next row's loads start only after this row's dx writes, and with one block an SM (8192 columns)
// DRAM reads pause for every row's block sum.
template <class T, int kPack, int kPacks, bool kSplit = false, bool kAsync = false>
__global__ void __launch_bounds__(512) backward_rows(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A scratch[64];
  __shared__ float2 parts[kSplit ? 2 : 1][32];  // (split rows only)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* sacc = reinterpret_cast<A*>(smem_raw);  // [nacc][cols], thread-owned columns
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const RowPart part = row_part<kSplit>(static_cast<int>(s.cols / kPack));
  const int npacks = kSplit ? part.count : static_cast<int>(s.cols / kPack);
  const int64_t cols = kSplit ? int64_t{npacks} * kPack : s.cols;  // (unsplit: as before the split)
  const int64_t first = int64_t{part.first} * kPack;
  const T* x = static_cast<const T*>(a.x) + first;
  const T* dy = static_cast<const T*>(a.dy) + first;
  T* dx = static_cast<T*>(a.dx) + first;
  T* const xs = reinterpret_cast<T*>(sacc + nacc * cols);  // (kAsync only)
  T* const ds = xs + cols;
  int parity = 0;
  for (int64_t slot = part.slot0; slot < s.groups * used; slot += part.slot_step) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols + first;
    Pack<A, kPack> zero;
#pragma unroll
    for (int e = 0; e < kPack; ++e) zero.v[e] = A(0);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = threadIdx.x + k * blockDim.x;
      if (p < npacks) {
        store_pack(sacc + p * kPack, zero);
        if (nacc == 2) store_pack(sacc + cols + p * kPack, zero);
      }
    }
    Pack<T, kPack> xp[kPacks], dp[kPacks];
    A mean = 0, rstd = 0;
    if (begin < end) {
      load_row_packs<T, kPack, kPacks>(x, dy, begin, s.cols, npacks, xp, dp);
      row_stats<T>(a, begin, mean, rstd);
    }
    for (int64_t row = begin; row < end; ++row) {  // block-uniform: the barriers below are safe
      // The scale packs are loop-invariant: without this clobber they (and their float conversions)
      // are hoisted out of the row loop and kept live, 16 registers; re-reading them is an L1 hit.
      asm volatile("" ::: "memory");
      A sum_g = 0, sum_gx = 0;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks)
          pack_sums<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, sum_g, sum_gx);
      }
      if constexpr (kAsync) {
        if (row + 1 < end) request_row_packs<T, kPack, kPacks>(xs, ds, x, dy, row + 1, s.cols, npacks);
      }
      if constexpr (kSplit) split_row_sums<kSplit>(sum_g, sum_gx, parts, parity);
      else block_sum2(sum_g, sum_gx, scratch);
      parity ^= 1;
      const A mg = s.rms ? A(0) : sum_g / A(s.cols), mgx = sum_gx / A(s.cols);
      // As in backward_warp: keep x and dy live across the barrier only in their storage type.
      opaque_packs(xp);
      opaque_packs(dp);
      T* dxr = dx + row * s.cols;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) {
          A as[kPack], ab[kPack];
          const auto cs = load_pack<A, kPack>(sacc + p * kPack);
          Pack<A, kPack> cb;
          if (nacc == 2) cb = load_pack<A, kPack>(sacc + cols + p * kPack);
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            as[e] = cs.v[e];
            ab[e] = nacc == 2 ? cb.v[e] : A(0);
          }
          store_pack(dxr + p * kPack,
                     pack_dx<T, kPack>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, rstd, mg, mgx,
                                       as, ab));  // rms_norm: ab is added to but never stored
          Pack<A, kPack> ns, nb;
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            ns.v[e] = as[e];
            nb.v[e] = ab[e];
          }
          store_pack(sacc + p * kPack, ns);
          if (nacc == 2) store_pack(sacc + cols + p * kPack, nb);
        }
      }
      if (row + 1 < end) {
        if constexpr (kAsync) {
          staged_row_packs<T, kPack, kPacks>(xs, ds, npacks, xp, dp);
        } else {
          load_row_packs<T, kPack, kPacks>(x, dy, row + 1, s.cols, npacks, xp, dp);
        }
        row_stats<T>(a, row + 1, mean, rstd);
      }
    }
    if (!kSplit && store_cluster_sums<T>(a, sacc)) continue;
    // Each thread owns its columns for the whole slot: write them straight to the slot's row.
    A* out = slot_ptr<T>(a, g, j) + first;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = threadIdx.x + k * blockDim.x;
      if (p < npacks) {
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          out[p * kPack + e] = sacc[p * kPack + e];
          if (nacc == 2) out[s.cols + p * kPack + e] = sacc[cols + p * kPack + e];
        }
      }
    }
  }
  leave_cluster<kSplit>();
}

// dscale[g][c] (and dbias) = sum over the first `used` slots of group g, in slot order.
// Block (32 columns) x (kLanes slot lanes): lane y adds slots y, y + kLanes, ...; the lane sums
// are then added in lane order, so the result depends only on `used` (the shape and the device),
// not on the launch. The 1-D grid walks column tiles fastest, then (group, accumulator) pairs.
// nvcc unrolls the slot loop 16 deep (16 loads in flight a thread): with 8 lanes (sessions 1-5) a
// 4096-column backward's 528 slots took 4-5 such round trips per thread on 256 blocks, 1024
// columns (264 slots) 2-3 on only 64 blocks; 32 lanes (session 6) take 1-2 and 4x the warps
// (H100: 0-4 us faster a backward). Groups of few slots (per-example parameters under vmap: 8
// groups of 16 rows of 65536 columns left 2 slots a group) ran 32768 blocks of 1024 threads, 30
// of every 32 idle, for 230 us (session 41): 17-64 slots take 8 lanes, fewer reduce_few_slots.
constexpr int kSlotLanes = 32;
constexpr int64_t kFewSlots = 16;

inline int slot_lanes(int64_t used) { return used > 64 ? kSlotLanes : 8; }

// A thread per (group, accumulator, column) adds the group's `used` <= kFewSlots slots in slot
// order; 256 threads a block along the columns.
template <class T>
__global__ void __launch_bounds__(256) reduce_few_slots(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= s.groups * nacc * s.cols) return;
  const int64_t c = i % s.cols, pair = i / s.cols;
  const int64_t g = pair / nacc;
  const int which = static_cast<int>(pair % nacc);
  A sum = 0;
#pragma unroll 4
  for (int64_t j = 0; j < used; ++j) sum += slot_ptr<T>(a, g, j)[which * s.cols + c];
  T* out = static_cast<T*>(which == 0 ? a.dscale : a.dbias);
  out[g * s.cols + c] = from_acc<T>(sum);
}

template <class T, int kLanes>
__global__ void __launch_bounds__(32 * kLanes) reduce_slots(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  __shared__ A part[kLanes][33];
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int64_t tiles = (s.cols + 31) / 32;
  const int64_t c = (blockIdx.x % tiles) * 32 + threadIdx.x;
  const int64_t pair = blockIdx.x / tiles;
  const int64_t g = pair / nacc;
  const int which = static_cast<int>(pair % nacc);
  A sum = 0;
  if (c < s.cols)
    for (int64_t j = threadIdx.y; j < used; j += kLanes) sum += slot_ptr<T>(a, g, j)[which * s.cols + c];
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < s.cols) {
    A total = 0;
#pragma unroll
    for (int y = 0; y < kLanes; ++y) total += part[y][threadIdx.x];
    T* out = static_cast<T*>(which == 0 ? a.dscale : a.dbias);
    out[g * s.cols + c] = from_acc<T>(total);
  }
}

}  // namespace jaxops::layer_norm
