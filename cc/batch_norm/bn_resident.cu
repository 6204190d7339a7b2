// Training forward of batch_norm in one cooperative kernel, for inputs that fit in the GPU's
// shared memory (about 27 MB on an H100: float32 up to (16,112,112,32); 16-bit types up to 64K
// elements a block, e.g. bfloat16 BN+ReLU and BN+Add+ReLU (16,112,112,32)).
// Each block copies its slice of rows into shared memory and reduces it, the grid synchronises
// once to merge the partial statistics, and every block applies the normalisation from shared
// memory. x is read from DRAM once instead of twice, and the three kernels of the streaming path
// (statistics, merge, apply) become one.
//
// Measured (H100, session 7): float32 (16,112,112,32) BN+ReLU 37.3 -> 30.6 us (XLA 33.3),
// bfloat16 24.8 -> 20.2 us (XLA 21.2). The kernel runs at ~2.5 TB/s of its 2-pass traffic but not
// faster: the load, the reduction + grid barrier + merge and the apply run one after another on
// every SM. Session 7 found summing during the load, 16-byte M2 reads and an L2 prefetch of the
// residual no faster with the scalar reduction; session 26 (ncu, bfloat16 (16,112,112,32): every
// phase latency-bound, issue slots 42 % busy) put the kVec layout's first pass on the load, one
// division a channel and a constant valid count for whole packs in the apply: float32
// (16,112,112,32) 30.2 -> 29.4 us (with a residual 40.5 -> 39.7), bfloat16 20.0 -> 19.3.
// Tried there and dropped: cp.async for the slice (4.2 -> 4.5 us for the load phase), the
// merge's partials loaded 6 blocks at a time (2.1 -> 2.3 us: the 132 blocks reading the same
// partials contend in L2, the round trips are not what it waits on), and a shuffle tree instead
// of fold_lanes (1.4 -> 2.0 us).
//
// Statistics: per block two passes (shifted mean, then M2 around it, exact), the first on the
// load and the second over shared memory where the channels allow 16-byte reads (VecStats), else
// both over shared memory, shifted by the channel's first-row pivot like the streaming kernels
// (bn_reduce.cu). Every block shares the pivots, so the blocks' (shifted sum, M2) partials merge
// by plain sums (merge_sums) in a fixed order, identically in every block, so the result depends
// only on the shape and the device's SM count.
#include <cooperative_groups.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "batch_norm/bn_launch.h"
#include "batch_norm/bn_math.h"
#include "batch_norm/bn_moments.cuh"
#include "batch_norm/bn_resident.cuh"
#include "batch_norm/bn_test_hooks.h"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"

namespace jaxops::batch_norm {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

using namespace resident;  // kThreads, Smem, fold_lanes, normalize_pack, launch_cooperative (bn_resident.cuh)

constexpr int kLoadUnroll = 4;  // 16-byte packs a thread loads before it stores them: 64 KB in flight per SM
constexpr int64_t kLightBlockElems = 64 * 1024;  // see resident_forward_cuda
constexpr size_t kStageResidualBytes = 80 * 1024;  // see resident_forward_cuda
constexpr int64_t kMaxSumsEveryBlock = 32;  // see resident_forward_cuda
// Partials a lane of sum_channel holds: grids of up to 32 * kSumHeld blocks in one round trip (an
// H100 has 132 SMs); 5 fits 64 registers without spills.
constexpr int kSumHeld = 5;
// The merges of the blocks' partials (resident_forward_kernel's `merge`): merge_sums in every
// block or spread over the grid, or merge_spread (Chan merges) for grids past 32 * kSumHeld.
constexpr int kMergeSums = 0, kMergeSumsSpread = 1, kMergeChanSpread = 2;

// A block's M2 from its one pass (sum of squares about the pivot less n times the squared shifted
// mean) is kept only where n * mean^2 <= kOnePassShift * M2 in every channel: the cancellation
// then costs at most ~(1 + kOnePassShift) rounding errors of the sum of squares. Otherwise (the
// pivot, row 0 of the whole input, far from this block's mean: a trend, an outlier first row, a
// constant channel's rounding) the block makes the exact second pass about its mean.
constexpr float kOnePassShift = 16.f;

// The one pass's M2 of a channel: Q, the sum of squares about the pivot, less S * mean (S the
// shifted sum, mean = S / n).
__device__ __forceinline__ float one_pass_m2(float s, float mean, float q) { return fmaf(-s, mean, q); }

// Whether that M2 may stand: n * mean^2 = S * mean <= kOnePassShift * M2. NaN and inf fail, so the
// exact pass decides for them.
__device__ __forceinline__ bool one_pass_holds(float s, float mean, float m2) { return s * mean <= kOnePassShift * m2; }

// Copies the n elements at src into shared memory: 16-byte packs, kLoadUnroll of them in flight
// per thread, then the (last block's) tail element by element. kStats >= 1 (the kVec layout, n
// whole packs) also makes the first statistics pass while the packs are in registers: thread t's
// packs t, t + kThreads, ... are VecStats' rows of column t % Q, in order, and d = x - piv[k] of
// each pack's element k is added into acc[k]; kStats == 2 adds d * d into acq[k] too.
template <class T, int P, int kStats>
__device__ __forceinline__ void load_slice(const T* __restrict__ src, T* __restrict__ dst, int n,
                                           const float (&piv)[P], float (&acc)[P], float (&acq)[P]) {
  const int packs = n / P;
  for (int p0 = threadIdx.x; p0 < packs; p0 += kThreads * kLoadUnroll) {
    uint4 w[kLoadUnroll];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int p = p0 + u * kThreads;
      if (p < packs) w[u] = __ldg(reinterpret_cast<const uint4*>(src) + p);
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int p = p0 + u * kThreads;
      if (p < packs) {
        reinterpret_cast<uint4*>(dst)[p] = w[u];
        if constexpr (kStats > 0) {
          T v[P];
          memcpy(&v, &w[u], sizeof(v));
#pragma unroll
          for (int k = 0; k < P; ++k) {
            const float d = to_acc(v[k]) - piv[k];
            acc[k] += d;
            if constexpr (kStats == 2) acq[k] = fmaf(d, d, acq[k]);
          }
        }
      }
    }
  }
  for (int i = packs * P + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}

// y = act((x - shift) * a + b (+ res)) for the lane's P elements at local index i0 (< n), and
// the predicate bits (bit k: element i0 + k is positive; 0 past the end). A whole pack, every
// lane but the last block's tail, normalises with the count of valid elements a constant P, so
// no element is tested against the end (H100, session 26: ~20 of ~100 instructions an
// iteration at bfloat16).
template <class T, int P>
__device__ __forceinline__ uint32_t apply_pack(const T* __restrict__ xs, const T* __restrict__ res,
                                               T* __restrict__ y, const float (&sh)[P], const float (&a)[P],
                                               const float (&b)[P], int i0, int n, bool relu,
                                               bool res_staged) {
  T v[P], r[P];
  if (i0 + P <= n) {
    const uint4 w = *reinterpret_cast<const uint4*>(xs + i0);  // one 16-byte shared load
    memcpy(&v, &w, sizeof(v));
    if (res_staged) {  // res is the block's residual slice in shared memory
      const uint4 q = *reinterpret_cast<const uint4*>(res + i0);
      memcpy(&r, &q, sizeof(r));
    } else if (res) {
      cuda::load_vec<T, P>(res + i0, r);
    }
    const uint32_t bits = normalize_pack<T, P>(v, r, res != nullptr, sh, a, b, P, relu);
    cuda::store_vec<T, P>(y + i0, v);
    return bits;
  }
#pragma unroll
  for (int k = 0; k < P; ++k) {
    v[k] = i0 + k < n ? xs[i0 + k] : from_acc<T>(0.f);
    r[k] = res && i0 + k < n ? res[i0 + k] : from_acc<T>(0.f);
  }
  const uint32_t bits = normalize_pack<T, P>(v, r, res != nullptr, sh, a, b, n - i0, relu);
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (i0 + k < n) y[i0 + k] = v[k];
  return bits;
}

// Channel ch's mean and biased variance from every block's partial, summed by one warp (every
// lane returns the same values). ws: (2, C, G), block b's shifted sum at [0][ch][b] and its M2 at
// [1][ch][b], so a warp's loads are whole lines; lane l takes blocks l, l + 32, ..., all loaded in
// one round trip. All blocks shift by the same pivot, so no Chan step is needed: the shifted sums
// add up to the mean, and M2 = sum over blocks of M2_b + (S_b - n_b mean)^2 / n_b (within plus
// between, non-negative terms), one division a channel. The lane sums are xor butterflies, which
// leave the same value in every lane.
__device__ __forceinline__ void sum_channel(const float* ws, int ch, int C, int64_t R, int64_t rpb, float piv,
                                            float& mean, float& var) {
  const int lane = threadIdx.x % 32, G = gridDim.x;
  const float n_full = static_cast<float>(rpb), n_last = static_cast<float>(R - (G - 1) * rpb);
  const float inv_full = 1.f / n_full, inv_last = 1.f / n_last;
  const auto add = [](float a, float b) { return a + b; };
  const float* ps = ws + int64_t(ch) * G;  // written in this launch: not through __ldg
  const float* pq = ws + int64_t(C + ch) * G;
  float hs[kSumHeld], hq[kSumHeld];
#pragma unroll
  for (int i = 0; i < kSumHeld; ++i) {
    const int bk = lane + 32 * i;
    hs[i] = bk < G ? __ldcg(ps + bk) : 0.f;
    hq[i] = bk < G ? __ldcg(pq + bk) : 0.f;
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kSumHeld; ++i) s += hs[i];
  const float ms = cuda::warp_reduce(s, add) / static_cast<float>(R);  // the shifted mean
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < kSumHeld; ++i) {
    const int bk = lane + 32 * i;
    if (bk < G) {
      const bool last = bk == G - 1;
      const float d = hs[i] - (last ? n_last : n_full) * ms;
      m2 += hq[i] + d * d * (last ? inv_last : inv_full);
    }
  }
  mean = piv + ms;
  var = cuda::warp_reduce(m2, add) / static_cast<float>(R);
}

// After the grid barrier, the channels' statistics by sum_channel, a warp a channel. In every
// block alike (spread false: warp w takes channels w, w + 32, ...; block 0 writes mean and var),
// so every block gets bit-identical coefficients into sm.coef; or spread over the grid (warp w of
// block b takes channel b * 32 + w, and every G * 32 after it, and writes its mean, var and
// coefficients to global memory), then share_coefficients. params(ch): {pivot, scale, bias}, as
// merge_spread's.
template <class Params>
__device__ __forceinline__ void merge_sums(const float* ws, float* __restrict__ mean_out, float* __restrict__ var_out,
                                           float4* coef_g, const Smem& sm, int C, int64_t R, int64_t rpb, float eps,
                                           bool spread, Params params) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int first = spread ? blockIdx.x * kWarps + warp : warp, step = spread ? gridDim.x * kWarps : kWarps;
  for (int ch = first; ch < C; ch += step) {  // warp-uniform
    const float4 in = params(ch);
    float mean, var;
    sum_channel(ws, ch, C, R, rpb, in.x, mean, var);
    if (lane == 0) {
      if (spread || blockIdx.x == 0) {
        mean_out[ch] = mean;
        var_out[ch] = var;
      }
      const Coef<float> q = forward_coef<float>(in.y, in.z, mean, var, eps);
      const float4 cq = make_float4(q.shift, q.a, q.b, 0.f);
      if (spread)
        coef_g[ch] = cq;
      else
        sm.coef[coef_at(ch)] = cq;
    }
  }
  if (spread) share_coefficients(coef_g, sm, C);  // grid-uniform
  __syncthreads();
}

// kVec block statistics: thread t reads 16-byte packs of column pc = t % Q (channels pc * P ...,
// Q = C / P a power of two <= 32, so C is a power of two) from rows t / Q, t / Q + L, ...
// (L = kThreads / Q). The first pass (shifted sums) rides on the load (load_slice<kSum>), the
// second (M2 about the block's mean) reads shared memory. A pass's per-thread sums fold over the
// block by column_totals (bn_resident.cuh).
// H100, session 23: 16-byte reads instead of a thread a channel took the phase 5.8 -> 5.0 us at
// bfloat16 (16,112,112,32). Session 26: the first pass on the load, the pivots loaded before the
// slice and the tree instead of one thread adding the 32 warps' partials in turn (see below).
template <class T, int P>
struct VecStats {
  int Q, pc, jr, L;
  float piv[P];
  // Issued before the slice's loads, so their latency hides under the copy's.
  __device__ __forceinline__ VecStats(const T* __restrict__ x, int C) {
    Q = C / P;
    pc = threadIdx.x % Q;
    jr = threadIdx.x / Q;
    L = kThreads / Q;
#pragma unroll
    for (int k = 0; k < P; ++k) piv[k] = pivot_of(to_acc(x[pc * P + k]));
  }
  // Sums (x - pivot - mk[k])^2 over this thread's rows of the slice xs.
  __device__ __forceinline__ void m2_sums(const T* xs, int rows, int C, const float (&mk)[P], float (&acc)[P]) const {
#pragma unroll 2
    for (int r = jr; r < rows; r += L) {
      const uint4 w = *reinterpret_cast<const uint4*>(xs + static_cast<int64_t>(r) * C + pc * P);
      T v[P];
      memcpy(&v, &w, sizeof(v));
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const float e = to_acc(v[k]) - piv[k] - mk[k];
        acc[k] += e * e;
      }
    }
  }
  // The block's totals (column_totals) into tot[ch] and, with rows > 0, the mean tot[ch] / rows
  // into tot[C + ch]: one division a channel. Every thread must call it (it synchronises; tot is
  // valid after it returns).
  __device__ __forceinline__ void block_total(float (&acc)[P], int C, float* redf, float* tot, int rows) const {
    column_totals<P>(acc, C, redf, [](float a, float b) { return a + b; }, [&](int ch, float t) {
      tot[ch] = t;
      if (rows > 0) tot[C + ch] = t / static_cast<float>(rows);
    });
    __syncthreads();
  }
  // The one pass's totals: block_total's tot[ch] and tot[C + ch] from acc, and from the sums of
  // squares acq the M2 estimate tot[2 * C + ch] (one_pass_m2). Both in one
  // column_totals of pairs where its scratch holds them (C <= 64) and P = 4 (float32); else one
  // after the other (16-bit P = 8: the pairs spilled 8 bytes under the 64-register cap).
  __device__ __forceinline__ void block_total_squares(float (&acc)[P], float (&acq)[P], int C, float* redf,
                                                      float* tot, int rows) const {
    const float n = static_cast<float>(rows);
    if (P < 8 && column_totals_fit<float2>(C)) {
      float2 sq[P];
#pragma unroll
      for (int k = 0; k < P; ++k) sq[k] = make_float2(acc[k], acq[k]);
      column_totals<P>(sq, C, reinterpret_cast<float2*>(redf),
                       [](float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); },
                       [&](int ch, float2 t) {
                         const float m = t.x / n;
                         tot[ch] = t.x;
                         tot[C + ch] = m;
                         tot[2 * C + ch] = one_pass_m2(t.x, m, t.y);
                       });
      __syncthreads();
    } else {
      block_total(acc, C, redf, tot, rows);
      column_totals<P>(acq, C, redf, [](float a, float b) { return a + b; },
                       [&](int ch, float t) { tot[2 * C + ch] = one_pass_m2(tot[ch], tot[C + ch], t); });
      __syncthreads();
    }
  }
};

// Whether the kVec statistics apply: channels in whole 16-byte packs, Q a power of two <= 32,
// and the 32 warps' partials (32 * C floats) fit the reduction scratch.
__host__ __device__ constexpr bool vec_stats_fit(int64_t C, int P) {
  return C % P == 0 && ((C / P) & (C / P - 1)) == 0 && C / P <= 32 && column_totals_fit<float>(C);
}

// The apply runs on the first `apply_warps` warps, whose stride (apply_warps * 32 * P elements) is
// a multiple of C (host), so a lane meets the same P channels on every chunk and keeps their
// coefficients in registers.
template <class T, int P, bool kVec>
__global__ void __launch_bounds__(kThreads, 1)
resident_forward_kernel(const T* __restrict__ x, const float* __restrict__ scale, const float* __restrict__ bias,
                        const T* __restrict__ res, T* __restrict__ y, uint32_t* __restrict__ mask,
                        float* __restrict__ mean_out, float* __restrict__ var_out, float* __restrict__ ws,
                        float4* __restrict__ coef_g, int64_t R, int C, int64_t rpb, int lanes, float eps, bool relu,
                        bool with_mask, int merge, int apply_warps, bool res_staged, bool one_pass) {
  cuda::enter_kernel();
  const Smem sm = smem_layout(C);
  T* xs = reinterpret_cast<T*>(sm.data);
  const int64_t r0 = blockIdx.x * rpb;
  const int rows = static_cast<int>(min(rpb, R - r0));  // > 0 (plan)
  const int n = rows * C;
  const int64_t e0 = r0 * C;  // a multiple of 32 (plan): the slice owns whole mask words

  // (j, c): lanes threads per channel, thread j takes rows j, j + lanes, ...
  const int j = threadIdx.x / C, c = threadIdx.x - j * C;
  const bool active = j < lanes;
  // The block's partial of channel ch for the merge: shifted sum, shifted mean (merge_spread only),
  // M2 about it.
  const auto write_partial = [&](int ch, float sb, float mb, float m2) {
    if (merge == kMergeChanSpread) {  // merge_spread's (G, 3, C)
      float* p = ws + blockIdx.x * 3 * int64_t(C) + ch;
      p[0] = sb;
      p[C] = mb;
      p[2 * C] = m2;
    } else {  // sum_channel's (2, C, G)
      ws[int64_t(ch) * gridDim.x + blockIdx.x] = sb;
      ws[int64_t(C + ch) * gridDim.x + blockIdx.x] = m2;
    }
  };
  if constexpr (kVec) {
    const VecStats<T, P> vs(x, C);
    float* redf = reinterpret_cast<float*>(sm.red);
    float* tot = reinterpret_cast<float*>(sm.coef);  // free until the coefficients are written
    float acc[P], acq[P];
#pragma unroll
    for (int k = 0; k < P; ++k) acc[k] = acq[k] = 0.f;
    bool exact = true;
    if (one_pass) {  // grid-uniform
      load_slice<T, P, 2>(x + e0, xs, n, vs.piv, acc, acq);
      vs.block_total_squares(acc, acq, C, redf, tot, rows);  // its barriers also publish the slice
      bool far = false;
      if (static_cast<int>(threadIdx.x) < C) {
        const float sb = tot[threadIdx.x], mb = tot[C + threadIdx.x], m2 = tot[2 * C + threadIdx.x];
        far = !one_pass_holds(sb, mb, m2);
      }
      exact = __syncthreads_or(far);
    } else {
      load_slice<T, P, 1>(x + e0, xs, n, vs.piv, acc, acq);
      vs.block_total(acc, C, redf, tot, rows);  // its barriers also publish the slice
    }
    if (exact) {  // block-uniform
      float mk[P];
#pragma unroll
      for (int k = 0; k < P; ++k) {
        mk[k] = tot[C + vs.pc * P + k];
        acc[k] = 0.f;
      }
      vs.m2_sums(xs, rows, C, mk, acc);
      vs.block_total(acc, C, redf, tot + 2 * C, 0);
    }
    if (static_cast<int>(threadIdx.x) < C)
      write_partial(threadIdx.x, tot[threadIdx.x], tot[C + threadIdx.x], tot[2 * C + threadIdx.x]);
  } else {
    const float piv = active ? pivot_of(to_acc(x[c])) : 0.f;  // issued before the slice's loads
    float none[P] = {};
    load_slice<T, P, 0>(x + e0, xs, n, none, none, none);
    float s = 0.f, q = 0.f;  // q: the one pass's sum of squares about the pivot (kOnePassShift)
    __syncthreads();
    if (active)
      for (int r = j; r < rows; r += lanes) {
        const float d = to_acc(xs[r * C + c]) - piv;
        s += d;
        q = fmaf(d, d, q);  // unused where one_pass is off
      }
    sm.red[threadIdx.x].s = s;
    sm.red[threadIdx.x].m2 = q;
    fold_lanes(sm.red, j, c, C, lanes, [](FMoments& d, const FMoments& o) {
      d.s += o.s;
      d.m2 += o.m2;
    });
    const float sb = active ? sm.red[c].s : 0.f;
    const float mb = sb / static_cast<float>(rows);
    const float m2_one = active ? one_pass_m2(sb, mb, sm.red[c].m2) : 0.f;
    bool exact = true;
    if (one_pass)  // grid-uniform
      exact = __syncthreads_or(active && j == 0 && !one_pass_holds(sb, mb, m2_one));
    if (exact) {  // block-uniform
      float m2 = 0.f;
      if (active)
        for (int r = j; r < rows; r += lanes) {
          const float d = to_acc(xs[r * C + c]) - piv - mb;
          m2 += d * d;
        }
      __syncthreads();  // every thread has read red[c]
      sm.red[threadIdx.x].m2 = m2;
      fold_lanes(sm.red, j, c, C, lanes, [](FMoments& d, const FMoments& o) { d.m2 += o.m2; });
      if (active && j == 0) write_partial(c, sb, mb, sm.red[c].m2);
    } else if (active && j == 0) {
      write_partial(c, sb, mb, m2_one);
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kChunk = 32 * P;
  const int stride = apply_warps * kChunk;
  // The apply's chunks: fn(i, i0) for the warp's chunk i and the lane's pack i0 (maybe past n).
  const auto for_each_chunk = [&](auto fn) {
    for (int i = warp < apply_warps ? warp * kChunk : n; i < n; i += stride) fn(i, i + lane * P);
  };
  // The residual slice, staged (host: where it fits and pays): DRAM idles through the barrier and
  // the merge, so the residual is copied into shared memory after the x slice then, and the apply
  // only reads shared memory and writes. Each thread copies exactly the packs its apply reads, so
  // its own wait orders them and no barrier is needed.
  T* const rsm = xs + rpb * C;  // rpb * C is a multiple of 32: 16-byte aligned
  if (res_staged) {
    for_each_chunk([&](int, int i0) {
      if (i0 + P <= n) {
        __pipeline_memcpy_async(rsm + i0, res + e0 + i0, 16);
      } else {
        for (int k = 0; i0 + k < n && k < P; ++k) rsm[i0 + k] = res[e0 + i0 + k];
      }
    });
    __pipeline_commit();
  }
  cooperative_groups::this_grid().sync();

  // {pivot, scale, bias} of channel ch for the merges.
  const auto params = [&](int ch) { return make_float4(pivot_of(to_acc(x[ch])), scale[ch], bias[ch], 0.f); };
  if (merge == kMergeChanSpread)  // grid-uniform
    merge_spread(ws, mean_out, var_out, coef_g, sm, C, eps,
                 [&](int64_t bk) { return static_cast<float>(min(rpb, R - bk * rpb)); }, params);
  else
    merge_sums(ws, mean_out, var_out, coef_g, sm, C, R, rpb, eps, merge == kMergeSumsSpread, params);

  float sh[P], a[P], b[P];
  // Channels of the lane's elements on every chunk; C < P wraps within a pack.
  for (int k = 0, ck = (warp * kChunk + lane * P) % C; k < P; ++k, ck = ck + 1 == C ? 0 : ck + 1) {
    const float4 q = sm.coef[coef_at(ck)];
    sh[k] = q.x;
    a[k] = q.y;
    b[k] = q.z;
  }
  const T* rs = res_staged ? rsm : res ? res + e0 : nullptr;
  if (res_staged) __pipeline_wait_prior(0);
  uint32_t* mw = mask + e0 / 32;
  for_each_chunk([&](int i, int i0) {  // warp-uniform: the ballot sees all lanes
    uint32_t bits = 0;
    if (i0 < n) bits = apply_pack<T, P>(xs, rs, y + e0, sh, a, b, i0, n, relu, res_staged);
    if (with_mask) {
      const uint32_t word = cuda::warp_mask_words<P>(bits);
      const int w = i / 32 + lane;
      if (lane < P && w * 32 < n) mw[w] = word;
    }
  });
}


int pow2_floor(int v) {
  int p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

}  // namespace

cudaError_t resident_forward_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                                  const void* bias, const void* residual, void* y, uint32_t* mask, void* mean,
                                  void* var, void* ws, int64_t cap, void* coef, double eps, bool relu,
                                  bool* launched) {
  *launched = false;
  const int64_t R = v.rows, C = v.channels;
  if (resident_path_disabled() || v.groups != 1 || v.f64 || R < 1 || C < 1 || C > kMaxChannels) return cudaSuccess;
  if (!aligned(x) || !aligned(y) || (residual && !aligned(residual))) return cudaSuccess;
  cuda::DeviceInfo dev;
  if (cudaError_t err = cuda::device_info(&dev)) return err;
  const size_t esize = v.dtype == Dtype::kF32 ? 4 : 2;
  // Rows per block: a multiple of q so every slice starts on a mask word (and a 16-byte pack);
  // at least R / cap so the partials fit the workspace.
  const int64_t q = 32 / std::gcd<int64_t>(C, 32);
  const int64_t want = std::max<int64_t>(dev.sm_count, 1);
  int64_t rpb = cuda::ceil_div(std::max(cuda::ceil_div(R, want), cuda::ceil_div(R, cap)), q) * q;
  // Past kLightBlockElems a block the streaming kernels win, with a residual or 16-bit elements.
  // A residual: the apply also reads it from DRAM, one 16-byte load per lane and chunk, and its
  // latency is exposed: measured (H100, session 7) the one kernel wins at 48.7K elements a block
  // (float32 (16,112,112,32): 40.7 vs 43.8 us) and loses at 97K (bfloat16 (64,56,56,64): 50.6 vs
  // 46.5 us). 16-bit types hold twice the elements a byte, and this kernel's shared-memory passes
  // cost instructions an element: the streaming kernels, whose second read of an x this small hits
  // L2, were faster (H100, session 25, bfloat16: BN+ReLU (64,56,56,64), 97K elements a block, 34.8
  // against 38.5 us) except for BN+ReLU (16,112,112,32) (20.0 against 21.6). With a residual they
  // also were on the H100 then (BN+Add+ReLU (16,112,112,32), 48.7K, 24.8 against 26.7), but since
  // sessions 43 and 45 made this kernel's apply leaner the one kernel wins (H200, session 47:
  // 22.9 -> 20.2 us, same process).
  if ((residual || esize == 2) && rpb * C > kLightBlockElems) return cudaSuccess;
  // The apply runs on the most warps (at least half) whose stride is a multiple of C, so each lane
  // keeps its channels' coefficients in registers: C = 96, 112, 192, 320, 40, 7 on 28-30 warps.
  // Channel counts with no such stride (e.g. 1000) take the streaming kernels: reloading the
  // coefficients a pack lost to them (H100, session 28, BN+ReLU (2000,1000): float32 20.9 against
  // 17.4 us, bfloat16 27.8 against 18.4; (64,28,28,96) with a reload on every pack: float32 29.4,
  // bfloat16 32.9, on 30 warps 24.7 and 20.1).
  const int64_t pack = 16 / static_cast<int64_t>(esize);
  int apply_warps = kWarps;
  while (apply_warps > kWarps / 2 && apply_warps * 32 * pack % C != 0) --apply_warps;
  if (apply_warps * 32 * pack % C != 0) return cudaSuccess;
  const size_t slice_bytes = static_cast<size_t>(rpb * C) * esize;
  size_t smem = smem_head(C) + slice_bytes;
  if (smem > static_cast<size_t>(dev.max_smem_optin)) return cudaSuccess;
  // The residual slice staged in shared memory too (see the kernel), where it fits and the slice
  // is long enough in bytes: the staging copy delays the grid barrier, which only a long apply
  // earns back. Measured (H100, BN+Add+ReLU, µs, unstaged -> staged): 97 KB a block win, bfloat16
  // (16,112,112,32) 23.8 -> 22.8, (64,28,28,128) 26.2 -> 25.2, float32 (16,56,56,64) 23.7 -> 22.0,
  // (32,28,28,128) 24.5 -> 23.0, (16,28,28,256) 23.3 -> 22.1; 73 KB and less lose, bfloat16
  // (64,28,28,96) and (32,56,56,48) 20.7 -> 20.9 and 20.6 -> 20.8, 49 KB (16,56,56,64) 16.1 -> 16.8,
  // (32,28,28,128) 17.2 -> 17.9, (16,28,28,256) 15.6 -> 16.4 (session 65 run 4); 12-24 KB
  // (8,56,56,32) lose 0.2-0.4 (session 64).
  const size_t staged = smem + slice_bytes;
  const HookMode stage_hook = residual_stage_mode();
  bool res_staged = residual != nullptr && staged <= static_cast<size_t>(dev.max_smem_optin) &&
                    (stage_hook != HookMode::kAuto ? stage_hook == HookMode::kAlways
                                                   : slice_bytes >= kStageResidualBytes);
  if (res_staged) smem = staged;
  const int64_t blocks = cuda::ceil_div(R, rpb);
  const int lanes = pow2_floor(static_cast<int>(kThreads / C));
  // The merge: every block summing all partials reads C * G * 8 bytes of them from L2 (C / 32
  // channels a warp, one after another); past kMaxSumsEveryBlock channels the sums spread over
  // the grid are cheaper (one more grid barrier). H100, session 68, bfloat16 BN+ReLU, merge phase
  // (barrier to coefficients) every block / spread: C = 32 2.4 / 3.3 us (16.0 / 16.8 us the
  // kernel), C = 64 3.8 / 3.3 (14.3 / 13.9), C = 128 6.1 / 3.3, C = 256 11.0 / 3.2.
  int merge = C <= kMaxSumsEveryBlock ? kMergeSums : kMergeSumsSpread;
  if (const int m = merge_mode()) merge = m == 1 ? kMergeSums : m == 2 ? kMergeSumsSpread : kMergeChanSpread;
  if (blocks > 32 * kSumHeld) merge = kMergeChanSpread;
  bool one_pass = !one_pass_disabled();
  // A generic lambda, so that `if constexpr` drops the float64 instantiation.
  auto go = [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) <= 4) {
      constexpr int P = 16 / sizeof(T);
      const bool vec = vec_stats_fit(C, P);
      auto kernel = vec ? resident_forward_kernel<T, P, true> : resident_forward_kernel<T, P, false>;
      int64_t rows = R;
      int ci = static_cast<int>(C), li = lanes;
      float ef = static_cast<float>(eps);
      bool re = relu, with_mask = v.mask_words > 0;
      void* args[] = {&x,    &scale, &bias, &residual, &y,  &mask, &mean,      &var,  &ws,
                      &coef, &rows,  &ci,   &rpb,      &li, &ef,   &re,   &with_mask, &merge, &apply_warps,
                      &res_staged, &one_pass};
      return launch_resident(kernel, blocks, smem, dev, stream, args, launched);
    }
    return cudaSuccess;
  };
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    if (cudaError_t err = go(T{})) return err;
  });
  return cudaGetLastError();
}

}  // namespace jaxops::batch_norm
