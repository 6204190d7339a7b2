// Session 5: the lean register-row backward (`backward_rows_lean`) for bfloat16 / float16 rows of
// 2048-8192 columns (8-element packs, kPacks a thread, one block per row, one slot of rows per
// block); session 6: also 520-1024 columns, one pack a thread (kPacks 1, 96-128 threads), and
// the next row prefetched at 520-4096 columns (kPrefetch; 8192 columns keep session 5's kernel).
// Rewritten from backward_rows<bf16,8,2,0> (99 registers, 25 % occupancy, ~40 issued
// thread-instructions per element, 0.5 issues per cycle, DRAM 56-61 %):
//  - the dscale / dbias column sums live in dynamic shared memory, [nacc][cols] floats, each
//    thread touching only its own columns (16-byte chunks, threads adjacent: conflict free, no
//    barrier), as the float path does: the 32 accumulator registers are gone;
//  - 1/cols once per kernel; per row the sums are scaled by multiplications; sum(g * xhat) is
//    rstd * sum(g * (x - mean)), so the first pass needs no xhat;
//  - bfloat16 words convert with one SHL / LOP3 per element (unpack_floats), dx packs two at a
//    time (F2FP); the scale packs are held packed in registers for the whole slot (8 registers);
//  - dx = rstd * (g - mg - xhat * mgx) = fma(g, rstd, fma(xhat, -rstd * mgx, -rstd * mg)):
//    2 FFMA an element (g = dy * scale still rounded once, as in the row sums);
//  - rms_norm is its own instantiation (kRms): no mean, no mean(g), no dbias accumulator.
// Column sums keep the fixed per-slot order (rows of the slot in order, then reduce_slots), so
// dscale / dbias stay bit-reproducible.
#pragma once
#include "layer_norm/layer_norm_bwd_kernels.cuh"
#include "layer_norm/layer_norm_lean.cuh"
#include "layer_norm/layer_norm_split.cuh"

namespace jaxops::layer_norm {

// 64 registers at most: 2 blocks of 512 threads (8192 columns) or 4 of 256 (4096) per SM; one
// pack a thread (kPacks 1, 520-1024 columns, session 6, always with the prefetch): 8 blocks of
// <= 128 threads. Two packs with the next row prefetched (session 6, <= 4096 columns): 16 more
// registers, 3 blocks of 256.
template <int kPacks, bool kPrefetch>
constexpr int lean_rows_max_threads() { return kPacks == 1 ? 128 : kPrefetch ? 256 : 512; }
template <int kPacks, bool kPrefetch>
constexpr int lean_rows_min_blocks() { return kPacks == 1 ? 8 : kPrefetch ? 3 : 2; }

// Block-wide sums of two floats, every thread gets both, in a fixed order (deterministic): warp
// trees, then every warp adds the per-warp partials with the same lane tree. block_sum2's serial
// loop over the warps cost ~80 instructions a row per thread (5 per element at 16 a thread).
// scratch: 32 float2. Every thread of the block must call it.
__device__ __forceinline__ void block_sum2_lean(float& a, float& b, float2* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  a = cuda::warp_reduce<cuda::SumOp>(a);
  b = cuda::warp_reduce<cuda::SumOp>(b);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = make_float2(a, b);
  __syncthreads();
  const float2 v = lane < nwarps ? scratch[lane] : make_float2(0.0f, 0.0f);
  a = cuda::warp_reduce<cuda::SumOp>(v.x);
  b = cuda::warp_reduce<cuda::SumOp>(v.y);
}

// A thread's column sums of pack p (dy * xhat, and dy for layer_norm) into its shared-memory columns.
template <int kPack, bool kRms>
__device__ __forceinline__ void store_column_sums(float* sacc, int cols, int p, const float (&as)[kPack],
                                                  const float (&ab)[kPack]) {
#pragma unroll
  for (int c = 0; c < kPack; c += 4) {
    Pack<float, 4> cs, cb;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cs.v[i] = as[c + i];
      cb.v[i] = ab[c + i];
    }
    store_pack(sacc + p * kPack + c, cs);
    if constexpr (!kRms) store_pack(sacc + cols + p * kPack + c, cb);
  }
}

// A thread's column sums of pack p (dy * xhat, and dy for layer_norm) from its shared-memory columns.
template <int kPack, bool kRms>
__device__ __forceinline__ void load_column_sums(const float* sacc, int cols, int p, float (&as)[kPack],
                                                 float (&ab)[kPack]) {
#pragma unroll
  for (int c = 0; c < kPack; c += 4) {
    const auto cs = load_pack<float, 4>(sacc + p * kPack + c);
#pragma unroll
    for (int i = 0; i < 4; ++i) as[c + i] = cs.v[i];
    if constexpr (!kRms) {
      const auto cb = load_pack<float, 4>(sacc + cols + p * kPack + c);
#pragma unroll
      for (int i = 0; i < 4; ++i) ab[c + i] = cb.v[i];
    }
  }
}

// Copies a block's column sums (its threads' packs) from shared memory to its slot's partial row
// `out` (dy * xhat, then dy for layer_norm `out_cols` floats on).
template <int kPack, int kPacks, bool kRms>
__device__ __forceinline__ void copy_slot_sums(float* out, int64_t out_cols, const float* sacc, int cols, int npacks) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = threadIdx.x + k * blockDim.x;
    if (p < npacks) {
#pragma unroll
      for (int c = 0; c < kPack; c += 4) {
        store_pack(out + p * kPack + c, load_pack<float, 4>(sacc + p * kPack + c));
        if constexpr (!kRms) store_pack(out + out_cols + p * kPack + c, load_pack<float, 4>(sacc + cols + p * kPack + c));
      }
    }
  }
}

// One pack's terms of a row's dx sums, added in element order: sum(g) (layer_norm) and
// sum(g * (x - mean)), g = dy * scale rounded once.
template <class T, int kPack, bool kRms>
__device__ __forceinline__ void add_row_sums(const Pack<T, kPack>& xq, const Pack<T, kPack>& dq,
                                             const Pack<T, kPack>& sq, float mean, float& sum_g, float& sum_gxm) {
  float xf[kPack], df[kPack], sf[kPack];
  unpack_floats<T, kPack>(xq, xf);
  unpack_floats<T, kPack>(dq, df);
  unpack_floats<T, kPack>(sq, sf);
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const float gv = mul_rn(df[e], sf[e]);
    if constexpr (!kRms) sum_g += gv;
    sum_gxm = fmaf(gv, kRms ? xf[e] : xf[e] - mean, sum_gxm);
  }
}

// dx = fmaf(g, rstd, fmaf(xhat, c1, c0)) (derived at the top of this file), written once for the
// lean, pair and ring kernels: their dx, dscale and dbias must stay bit-identical to one another.
// A row's c1 = -rstd * mean(g * xhat) and c0 = -rstd * mean(g) (0 for rms_norm) from its block sums.
template <bool kRms>
__device__ __forceinline__ void dx_coefs(float sum_g, float sum_gxm, float rstd, float inv_cols, float& c1,
                                         float& c0) {
  const float mgx = sum_gxm * rstd * inv_cols;  // mean(g * xhat)
  c1 = -rstd * mgx;
  c0 = kRms ? 0.0f : -rstd * (sum_g * inv_cols);  // -rstd * mean(g)
}

// A pack's dx and its column terms in element order: dy * xhat into `as`, dy into `ab` (layer_norm).
// Floats in and out, so that each caller keeps its unpacks where they were (the pair kernels unpack
// the scale once for two rows): unpacking here reordered the float16 unpacks (inline asm) and changed
// the SASS of these tuned kernels; as it is, their cubins are byte-identical to the formula written
// out in each (session 47, sm_80 and sm_90, nvcc 13.0).
template <int kPack, bool kRms>
__device__ __forceinline__ void dx_pack(const float (&xf)[kPack], const float (&df)[kPack], const float (&sf)[kPack],
                                        float mean, float rstd, float c1, float c0, float (&out)[kPack],
                                        float (&as)[kPack], float (&ab)[kPack]) {
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    const float xhat = kRms ? xf[e] * rstd : (xf[e] - mean) * rstd;
    const float gv = mul_rn(df[e], sf[e]);  // rounded once, as in add_row_sums
    out[e] = fmaf(gv, rstd, fmaf(xhat, c1, c0));
    as[e] = fmaf(df[e], xhat, as[e]);
    if constexpr (!kRms) ab[e] += df[e];
  }
}

// The ring (kAhead rows of x and dy in shared memory, [kAhead][2][cols] of T, one pack a thread):
// entry `i` gets row `row` by cp.async, one commit group a call even past `end` (an empty group),
// so that "the group kAhead - 1 commits back" is always the oldest row's. Each thread copies and
// later reads only its own pack: no barrier.
template <class T, int kPack>
__device__ __forceinline__ void request_ring_row(T* ring, int i, int cols, const T* x, const T* dy, int64_t row,
                                                 int64_t end, int64_t row_stride, int npacks) {
  const int p = threadIdx.x;
  if (row < end && p < npacks) {
    T* xs = ring + int64_t{i} * 2 * cols;
    __pipeline_memcpy_async(xs + p * kPack, x + row * row_stride + p * kPack, 16);
    __pipeline_memcpy_async(xs + cols + p * kPack, dy + row * row_stride + p * kPack, 16);
  }
  __pipeline_commit();
}

// kPrefetch (session 6): the next row's x, dy, mean and rstd are loaded right after the first
// pass, so they are in flight during the row reduction's barriers and the second pass (+8
// registers a pack a thread); otherwise they are loaded after dx is written. (Session 4's
// prefetch lost 2-4 % in the 99-register, instruction-bound backward_rows; this kernel issues
// ~29-37 instructions an element instead of ~40.) H100, session 6, bf16 layer_norm_bwd: 1024
// columns 159.1 -> 151.6 us with the prefetch, 4096 columns 163.7 -> 158.9.
// kSplit (session 32): the row's packs are split over the blocks of a cluster
// (layer_norm_split.cuh); this block sees only its own columns, from `first` on.
// kRegAcc (session 39, one pack a thread: <= 1024 columns): the column sums stay in registers for
// the whole slot and reach shared memory once, at its end, instead of a shared-memory round trip a
// row; the same additions in the same order (bit-identical). The kernel was bound by shared memory
// (session 38 ncu: short scoreboard the top stall, Mem Busy 85 %, DRAM 49 %). H200: bf16
// layer_norm_bwd 131072x1024 261.3 -> 220.1 us (0.722 -> 0.857 of the bound), 65536x776 128.2 ->
// 107.9; rms_norm_bwd (one accumulator) unchanged. With two packs (1032-4096 columns) 80 registers
// spill 80 bytes and 2048 / 4096 columns ran 1.6x slower, so they keep the shared round trip.
template <class T, int kPack, int kPacks, bool kRms, bool kPrefetch, bool kSplit>
__device__ __forceinline__ void backward_rows_lean_body(const BackwardArgs& a, int64_t used, float2* scratch,
                                                        float2 (*parts)[32]) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sacc = reinterpret_cast<float*>(smem_raw);  // [kNacc][cols], thread-owned columns
  constexpr bool kRegAcc = kPacks == 1;
  const Shape& s = a.shape;
  // (Unsplit, cols and npacks are computed as before the split existed: the same code.)
  const RowPart part = row_part<kSplit>(static_cast<int>(s.cols / kPack));
  const int cols = kSplit ? part.count * kPack : static_cast<int>(s.cols);  // this block's columns: <= 8192
  const int npacks = kSplit ? part.count : cols / kPack;
  const int64_t first = int64_t{part.first} * kPack;
  const float inv_cols = a.inv_cols;
  const T* x = static_cast<const T*>(a.x) + first;
  const T* dy = static_cast<const T*>(a.dy) + first;
  T* dx = static_cast<T*>(a.dx) + first;
  const float* means = static_cast<const float*>(a.mean);
  const float* rstds = static_cast<const float*>(a.rstd);
  int parity = 0;
  // (Unsplit, the loop reads blockIdx / gridDim directly, so the unsplit kernels compile to the
  // same code as before the split existed. Through RowPart's 64-bit fields the code differed, and
  // bf16 8192-column layer_norm_bwd read 3 % slower in every run after it: 154.3 -> 158.8-159.4 us.)
  for (int64_t slot = kSplit ? part.slot0 : blockIdx.x; slot < s.groups * used;
       slot += kSplit ? part.slot_step : gridDim.x) {
    const int64_t g = slot / used, j = slot % used;  // (once per slot)
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols + first;
    Pack<T, kPack> sp[kPacks];
    const Pack<float, 4> zero{};
    float racc_s[kPacks][kPack], racc_b[kPacks][kPack];  // (kRegAcc only)
    if constexpr (kRegAcc) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
#pragma unroll
        for (int e = 0; e < kPack; ++e) racc_s[k][e] = racc_b[k][e] = 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = threadIdx.x + k * blockDim.x;
      if (p < npacks) {
        sp[k] = load_pack<T, kPack>(scale + p * kPack);
        if constexpr (!kRegAcc) {
#pragma unroll
          for (int c = 0; c < kPack; c += 4) {
            store_pack(sacc + p * kPack + c, zero);
            if constexpr (!kRms) store_pack(sacc + cols + p * kPack + c, zero);
          }
        }
      }
    }
    Pack<T, kPack> xp[kPacks], dp[kPacks];
    float mean = 0.0f, rstd = 0.0f;
    if (begin < end) {
      load_row_packs<T, kPack, kPacks>(x, dy, begin, s.cols, npacks, xp, dp);
      if constexpr (!kRms) mean = means[begin];
      rstd = rstds[begin];
    }
    for (int64_t row = begin; row < end; ++row) {  // block-uniform: the barriers below are safe
      // Pass 1: sum(g) and sum(g * (x - mean)), g = dy * scale rounded once.
      float sum_g = 0.0f, sum_gxm = 0.0f;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) add_row_sums<T, kPack, kRms>(xp[k], dp[k], sp[k], mean, sum_g, sum_gxm);
      }
      Pack<T, kPack> xn[kPacks], dn[kPacks];
      float mean_n = 0.0f, rstd_n = 0.0f;
      if constexpr (kPrefetch) {  // the next row's packs and statistics
        if (row + 1 < end) {
          load_row_packs<T, kPack, kPacks>(x, dy, row + 1, s.cols, npacks, xn, dn);
          if constexpr (!kRms) mean_n = means[row + 1];
          rstd_n = rstds[row + 1];
        }
      }
      if constexpr (kSplit) split_row_sums<kSplit>(sum_g, sum_gxm, parts, parity);
      else block_sum2_lean(sum_g, sum_gxm, scratch);
      parity ^= 1;
      float c1, c0;
      dx_coefs<kRms>(sum_g, sum_gxm, rstd, inv_cols, c1, c0);
      // Keep x and dy live across the barrier only packed (the converted floats would be 32 more).
      opaque_packs(xp);
      opaque_packs(dp);
      // Pass 2: dx, and the column sums dy * xhat (and dy) of the thread's own columns.
      T* dxr = dx + row * s.cols;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) {
          float xf[kPack], df[kPack], sf[kPack], out[kPack], as[kPack], ab[kPack];
          unpack_floats<T, kPack>(xp[k], xf);
          unpack_floats<T, kPack>(dp[k], df);
          unpack_floats<T, kPack>(sp[k], sf);
          if constexpr (kRegAcc) {
#pragma unroll
            for (int e = 0; e < kPack; ++e) {
              as[e] = racc_s[k][e];
              ab[e] = racc_b[k][e];
            }
          } else {
            load_column_sums<kPack, kRms>(sacc, cols, p, as, ab);
          }
          dx_pack<kPack, kRms>(xf, df, sf, mean, rstd, c1, c0, out, as, ab);
          store_pack(dxr + p * kPack, pack_floats<T, kPack>(out));
          if constexpr (kRegAcc) {
#pragma unroll
            for (int e = 0; e < kPack; ++e) {
              racc_s[k][e] = as[e];
              racc_b[k][e] = ab[e];
            }
          } else {
            store_column_sums<kPack, kRms>(sacc, cols, p, as, ab);
          }
        }
      }
      if (row + 1 < end) {
        if constexpr (kPrefetch) {
#pragma unroll
          for (int k = 0; k < kPacks; ++k) {
            xp[k] = xn[k];
            dp[k] = dn[k];
          }
          mean = mean_n;
          rstd = rstd_n;
        } else {
          load_row_packs<T, kPack, kPacks>(x, dy, row + 1, s.cols, npacks, xp, dp);
          if constexpr (!kRms) mean = means[row + 1];
          rstd = rstds[row + 1];
        }
      }
    }
    if constexpr (kRegAcc) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) store_column_sums<kPack, kRms>(sacc, cols, p, racc_s[k], racc_b[k]);
      }
    }
    if (!kSplit && store_cluster_sums<T>(a, sacc)) continue;
    // Each thread owns its columns for the whole slot: copy them to the slot's partial row.
    copy_slot_sums<kPack, kPacks, kRms>(slot_ptr<T>(a, g, j) + first, kSplit ? s.cols : cols, sacc, cols, npacks);
  }
  leave_cluster<kSplit>();
}

template <class T, int kPack, int kPacks, bool kPrefetch = false, bool kSplit = false>
__global__ void __launch_bounds__(lean_rows_max_threads<kPacks, kPrefetch>(),
                                  lean_rows_min_blocks<kPacks, kPrefetch>())
    backward_rows_lean(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  static_assert(sizeof(T) == 2 && kPack == 8, "8-element packs of bfloat16 / float16");
  __shared__ float2 scratch[32];  // (one array for both bodies)
  __shared__ float2 parts[kSplit ? 2 : 1][32];  // (split rows only)
  if (a.shape.rms) backward_rows_lean_body<T, kPack, kPacks, true, kPrefetch, kSplit>(a, used, scratch, parts);
  else backward_rows_lean_body<T, kPack, kPacks, false, kPrefetch, kSplit>(a, used, scratch, parts);
}

// 16-bit layer_norm rows of 6152-8192 columns as one pack a thread (up to 1024 threads, one block
// an SM), so that kRegAcc keeps the column sums in registers (no shared round trip a row); 64
// registers, no spill (session 42). It lost at 4104 columns and for rms_norm (bwd.cu's launcher
// has the numbers): one block an SM stalls at every block sum.
// Where its shared memory fits, backward_rows_lean_1024_ring (layer_norm_pair_bwd.cuh) runs instead:
// the same arithmetic with the next rows by cp.async; this kernel is its register-prefetch
// fallback (sm_80's 163 KB a block; JAXOPS_LN_NO_RING=1 forces it for the tests).
template <class T, int kPack>
__global__ void __launch_bounds__(1024, 1) backward_rows_lean_1024(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  static_assert(sizeof(T) == 2 && kPack == 8, "8-element packs of bfloat16 / float16");
  __shared__ float2 scratch[32];
  __shared__ float2 parts[1][32];
  // layer_norm only: the launcher sends rms_norm rows to backward_rows_lean.
  backward_rows_lean_body<T, kPack, 1, false, true, false>(a, used, scratch, parts);
}

}  // namespace jaxops::layer_norm
