// Training backward of batch_norm in one cooperative kernel: each block (one per SM) keeps a
// slice of dy's and x's rows in shared memory and streams a span of the others. The streaming
// path (sums kernel, merge, dx kernel) reads dy and x twice; here the slices (about 28 MB on an
// H100, dy and x together: all of bfloat16 (16,112,112,32), 27 % of bfloat16 (128,28,28,256))
// are read once, and three kernels become one. The forward's bn_hybrid.cu with the backward's
// arithmetic:
//
// Phase 1: every block copies its slice into shared memory and reads its span, adding
// sum(dy') and sum(dy' * (x - mean)) (dy' = dy where the relu bit is set) per channel as the
// 16-byte packs arrive; a fixed-order fold of the threads' sums into the block's. Grid barrier,
// the merge spread over the grid (block b merges channels b, b + G, ...: the sums, then the
// backward coefficients), a second barrier. Phase 2: dx = a * dy' + b * (x - mean) + c (and
// dresidual = dy') over the span, last chunk first (its end, read last, is still in L2), then
// over the slice from shared memory. Every sum is taken in an order fixed by the shape and the
// SM count: bit-identical results on every run.
//
// Measured (H100, session 25, same-run against the sums + dx kernels, us): BN+ReLU backward
// bfloat16 (128,28,28,256) 112.9 -> 96.6 (XLA 260.0), (256,56,56,64) 209.9 -> 188.8,
// (16,112,112,32) 31.6 -> 28.2; float32 (16,112,112,32) 54.6 -> 44.2, (128,28,28,256) 183.6 ->
// 176.7; BN+Add+ReLU bfloat16 (128,28,28,256) 128.6 -> 115.1. Where the slices hold under a
// tenth of the rows (float32 (256,56,56,64)) the launcher leaves it to the two kernels.
// Session 26 (fold_sums_tree, the slice's relu bits in shared memory): bfloat16 (16,112,112,32)
// 28.2 -> 25.4, (256,56,56,64) 188.8 -> 184.0, (128,28,28,256) 96.8 -> 94.9.
#include <cooperative_groups.h>

#include <cstdint>

#include "batch_norm/bn_launch.h"
#include "batch_norm/bn_math.h"
#include "batch_norm/bn_resident.cuh"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"

namespace jaxops::batch_norm {
namespace {

using cuda::from_acc;
using cuda::to_acc;
using namespace resident;

// Packs of dy (and as many of x) a thread has in flight: phase 1 float32 2 x 64 KB an SM, 16-bit
// types 2 x 32 KB (their 8 channels' sums take the registers); the apply half of that (the lane's
// coefficients take them: 4 P floats).
template <class T>
constexpr int grad_unroll() {
  return sizeof(T) == 4 ? 4 : 2;
}
template <class T>
constexpr int dx_unroll() {
  return sizeof(T) == 4 ? 2 : 1;
}

template <class T, int P>
using Row = cuda::Pack<T, P>;

// One thread's sums of its P channels over the packs it visits.
template <int P>
struct GradSums {
  float s1[P], s2[P], mu[P];

  template <class T>
  __device__ __forceinline__ void add(const Row<T, P>& g, const Row<T, P>& v, uint32_t bits) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (!((bits >> k) & 1u)) continue;  // select, not multiply: a masked NaN/inf dy is dropped
      const float gd = to_acc(g.v[k]);
      s1[k] += gd;
      s2[k] += gd * (to_acc(v.v[k]) - mu[k]);
    }
  }
};

// Adds packs threadIdx.x, + kThreads, ... of the `packs`-pack run whose first element is element
// e0 of the view (dy + e0, x + e0); kCopy also stores them in the slice (sdy, sx) and, with a
// mask, each pack's relu bits in sbits (a byte a pack). The loads of a batch are all issued
// before it is added.
template <class T, int P, bool kCopy>
__device__ __forceinline__ void sum_run(const T* __restrict__ dy, const T* __restrict__ x,
                                        const uint32_t* __restrict__ mask, int64_t e0, T* __restrict__ sdy,
                                        T* __restrict__ sx, uint8_t* __restrict__ sbits, int64_t packs,
                                        GradSums<P>& gs) {
  constexpr int U = grad_unroll<T>();
  const Row<T, P>* gp = reinterpret_cast<const Row<T, P>*>(dy + e0);
  const Row<T, P>* xp = reinterpret_cast<const Row<T, P>*>(x + e0);
  for (int64_t p0 = threadIdx.x; p0 < packs; p0 += int64_t(U) * kThreads) {
    Row<T, P> g[U], v[U];
    uint32_t bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = p0 + u * kThreads;
      if (p < packs) {
        const uint4 wg = __ldg(reinterpret_cast<const uint4*>(gp + p));
        const uint4 wx = __ldg(reinterpret_cast<const uint4*>(xp + p));
        memcpy(&g[u], &wg, 16);
        memcpy(&v[u], &wx, 16);
        bits[u] = mask ? cuda::mask_bits<P>(mask, e0 + p * P) : ~0u;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = p0 + u * kThreads;
      if (p < packs) {
        if constexpr (kCopy) {
          reinterpret_cast<Row<T, P>*>(sdy)[p] = g[u];
          reinterpret_cast<Row<T, P>*>(sx)[p] = v[u];
          if (mask) sbits[p] = static_cast<uint8_t>(bits[u]);
        }
        gs.add(g[u], v[u], bits[u]);
      }
    }
  }
}

// Folds every thread's sums into the block's and writes them to its workspace slot (ws: (G, 2, C)
// of sum(dy'), sum(dy' (x - mean))) in a fixed order, the forward's fold_block with sums: thread
// t holds row t / Q of pack column t % Q (Q = C / P); in round r (P rounds) the threads of rows
// r * H ... (H = kThreads / C) store their P channels and thread (j, c) adds row r * H + j of
// channel c; then a tree over j.
template <int P>
__device__ __forceinline__ void fold_sums(const GradSums<P>& gs, float2* red, float* __restrict__ ws, int C) {
  const int Q = C / P, H = kThreads / C, writers = kThreads / P;
  const int j = threadIdx.x / C, c = threadIdx.x % C;
  float a1 = 0.f, a2 = 0.f;
  for (int r = 0; r < P; ++r) {
    __syncthreads();  // the previous round's readers are done
    const int w = static_cast<int>(threadIdx.x) - r * writers;
    if (w >= 0 && w < writers) {  // warp-uniform
      const int row = w / Q, ch = (threadIdx.x % Q) * P;
#pragma unroll
      for (int k = 0; k < P; ++k) red[row * C + ch + k] = make_float2(gs.s1[k], gs.s2[k]);
    }
    __syncthreads();
    const float2 v = red[j * C + c];
    a1 += v.x;
    a2 += v.y;
  }
  __syncthreads();
  red[threadIdx.x] = make_float2(a1, a2);
  for (int s = H / 2; s > 0; s /= 2) {
    __syncthreads();
    if (j < s) {
      const float2 o = red[(j + s) * C + c];
      red[threadIdx.x].x += o.x;
      red[threadIdx.x].y += o.y;
    }
  }
  __syncthreads();
  if (j == 0) {
    ws[blockIdx.x * 2 * int64_t(C) + c] = red[c].x;
    ws[blockIdx.x * 2 * int64_t(C) + C + c] = red[c].y;
  }
}

// fold_sums for C <= 64 (the 32 warps' float2 partials then fit the scratch) by column_totals
// (bn_resident.cuh), like the resident forward's statistics: two block barriers where fold_sums
// has 2 P + 1 + log2(kThreads / C).
template <int P>
__device__ __forceinline__ void fold_sums_tree(const GradSums<P>& gs, float2* red, float* __restrict__ ws, int C) {
  float2 acc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) acc[k] = make_float2(gs.s1[k], gs.s2[k]);
  column_totals<P>(acc, C, red, [](float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); },
                   [&](int ch, float2 t) {
                     ws[blockIdx.x * 2 * int64_t(C) + ch] = t.x;
                     ws[blockIdx.x * 2 * int64_t(C) + C + ch] = t.y;
                   });
}

// The merge spread over the grid, as the forward's merge_spread: block b merges the channels of
// rounds b, b + G, ... (per channels a round), thread (j, cs) loading block j's sums of channel
// cs, a fixed tree over j; thread j = 0 writes the channel's sums and backward coefficients. The
// per-channel operands are loaded with the partials, so their latency overlaps. A second grid
// barrier, then every block loads the C coefficient records into shared memory.
__device__ __forceinline__ void merge_grad_spread(const float* ws, const float* __restrict__ scale,
                                                  const float* __restrict__ mean, const float* __restrict__ var,
                                                  const float* __restrict__ dmean, const float* __restrict__ dvar,
                                                  float* __restrict__ sum_dy, float* __restrict__ sum_dyxhat,
                                                  float4* coef_g, const Smem& sm, int C, float eps, float count) {
  const int G = gridDim.x;
  int gp = 1;
  while (gp < G) gp *= 2;
  const int per = kThreads / gp;  // channels a round (the host keeps G <= kThreads)
  const int j = threadIdx.x / per, cs = threadIdx.x % per;
  float2* red = reinterpret_cast<float2*>(sm.red);
  for (int c0 = blockIdx.x * per; c0 < C; c0 += G * per) {  // block-uniform bounds
    const int c = c0 + cs;
    const bool head = j == 0 && c < C;
    float sc = 0.f, mu = 0.f, va = 0.f, dm = 0.f, dv = 0.f;
    if (head) {
      sc = scale[c];
      mu = mean[c];
      va = var[c];
      dm = dmean[c];
      dv = dvar[c];
    }
    float2 v = make_float2(0.f, 0.f);
    if (c < C && j < G) {
      const float* p = ws + j * 2 * int64_t(C) + c;  // written in this launch: not through __ldg
      v = make_float2(__ldcg(p), __ldcg(p + C));
    }
    __syncthreads();  // the previous round's reads of red are done
    red[threadIdx.x] = v;
    for (int s = gp / 2; s > 0; s /= 2) {
      __syncthreads();
      if (j < s) {
        const float2 o = red[threadIdx.x + s * per];
        red[threadIdx.x].x += o.x;
        red[threadIdx.x].y += o.y;
      }
    }
    __syncthreads();
    if (head) {
      const float s1 = red[cs].x, s2 = red[cs].y * inv_std(va, eps);  // as grad_merge_kernel
      sum_dy[c] = s1;
      sum_dyxhat[c] = s2;
      const Coef<float> q = backward_coef<float>(sc, mu, va, eps, s1, s2, dm, dv, count, true);
      coef_g[c] = make_float4(q.shift, q.a, q.b, q.c);
    }
  }
  share_coefficients(coef_g, sm, C);
  __syncthreads();
}

// dx (and dresidual) for the n elements (whole P-packs, starting on a row and a mask word) of the
// run whose first element is element e0 of the view; dy and x come from gdy, gx (global memory
// for the span, the slice for the slice), the relu bits from sbits where given (the slice's,
// kept by phase 1: the global mask word was a round trip an iteration with one pack in flight,
// H100, session 26), else from the mask. The warp stride is a multiple of C, so a lane's
// coefficients stay in registers. `reverse` walks the warp's chunks last first.
template <class T, int P>
__device__ __forceinline__ void dx_run(const T* gdy, const T* gx, const uint32_t* __restrict__ mask,
                                       const uint8_t* sbits, int64_t e0, T* __restrict__ dx, T* __restrict__ dres,
                                       int64_t n, const float4* coef, int C, bool reverse) {
  constexpr int U = dx_unroll<T>();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kChunk = 32 * P;
  constexpr int64_t kStride = int64_t(kWarps) * kChunk;
  float sh[P], a[P], b[P], cc[P];
  static_assert(8 % P == 0, "coef_at(cl + k) == coef_at(cl) + k");
  const float4* cq = coef + coef_at((warp * kChunk + lane * P) % C);
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const float4 q = cq[k];
    sh[k] = q.x;
    a[k] = q.y;
    b[k] = q.z;
    cc[k] = q.w;
  }
  const int64_t first = warp * kChunk;
  const int64_t chunks = first < n ? (n - first + kStride - 1) / kStride : 0;  // this warp's
  for (int64_t g0 = 0; g0 < chunks; g0 += U) {
    Row<T, P> g[U], v[U];
    uint32_t bits[U];
    int64_t i0[U];  // the lane's first element; -1 past the warp's last chunk or the run's end
#pragma unroll
    for (int u = 0; u < U; ++u) {
      i0[u] = -1;
      if (g0 + u < chunks) {
        const int64_t i = first + (reverse ? chunks - 1 - g0 - u : g0 + u) * kStride + lane * P;
        if (i < n) {
          i0[u] = i;
          const uint4 wg = *reinterpret_cast<const uint4*>(gdy + i);
          const uint4 wx = *reinterpret_cast<const uint4*>(gx + i);
          memcpy(&g[u], &wg, 16);
          memcpy(&v[u], &wx, 16);
          bits[u] = !mask ? ~0u : sbits ? sbits[i / P] : cuda::mask_bits<P>(mask, e0 + i);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0[u] < 0) continue;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        if (!((bits[u] >> k) & 1u)) g[u].v[k] = from_acc<T>(0.f);  // select: a masked NaN dy gives 0
        v[u].v[k] = from_acc<T>(a[k] * to_acc(g[u].v[k]) + b[k] * (to_acc(v[u].v[k]) - sh[k]) + cc[k]);
      }
      cuda::store_vec<T, P>(dx + e0 + i0[u], v[u].v);
      if (dres) cuda::store_vec<T, P>(dres + e0 + i0[u], g[u].v);
    }
  }
}

template <class T, int P>
__global__ void __launch_bounds__(kThreads, 1)
hybrid_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint32_t* __restrict__ mask,
                       const float* __restrict__ scale, const float* __restrict__ mean,
                       const float* __restrict__ var, const float* __restrict__ dmean,
                       const float* __restrict__ dvar, T* __restrict__ dx, T* __restrict__ dres,
                       float* __restrict__ sum_dy, float* __restrict__ sum_dyxhat, float* __restrict__ ws,
                       float4* __restrict__ coef_g, Split sp, int C, float eps) {
  cuda::enter_kernel();
  const Smem sm = smem_layout(C);
  T* sdy = reinterpret_cast<T*>(sm.data);
  T* sx = sdy + sp.rpb * C;
  uint8_t* sbits = reinterpret_cast<uint8_t*>(sx + sp.rpb * C);  // with a mask: rpb * C / P bytes
  const int64_t e0 = blockIdx.x * sp.rpb * C, n0 = sp.slice_rows(blockIdx.x) * C;
  const int64_t e1 = sp.span_r0(blockIdx.x) * C, n1 = sp.span_rows(blockIdx.x) * C;

  GradSums<P> gs;
  const int ch = (threadIdx.x % (C / P)) * P;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    gs.s1[k] = gs.s2[k] = 0.f;
    gs.mu[k] = mean[ch + k];
  }
  sum_run<T, P, true>(dy, x, mask, e0, sdy, sx, sbits, n0 / P, gs);
  sum_run<T, P, false>(dy, x, mask, e1, nullptr, nullptr, nullptr, n1 / P, gs);
  if (column_totals_fit<float2>(C))
    fold_sums_tree<P>(gs, reinterpret_cast<float2*>(sm.red), ws, C);
  else
    fold_sums<P>(gs, reinterpret_cast<float2*>(sm.red), ws, C);
  cooperative_groups::this_grid().sync();

  merge_grad_spread(ws, scale, mean, var, dmean, dvar, sum_dy, sum_dyxhat, coef_g, sm, C, eps,
                    static_cast<float>(sp.R));
  dx_run<T, P>(dy + e1, x + e1, mask, nullptr, e1, dx, dres, n1, sm.coef, C, true);
  dx_run<T, P>(sdy, sx, mask, sbits, e0, dx, dres, n0, sm.coef, C, false);
}

}  // namespace

cudaError_t hybrid_backward_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                                 const uint32_t* mask, const void* scale, const void* mean, const void* var,
                                 const void* dmean, const void* dvar, void* dx, void* dres, void* sum_dy,
                                 void* sum_dyxhat, void* ws, int64_t cap, void* coef, double eps,
                                 bool* launched) {
  *launched = false;
  if (!aligned(dy) || !aligned(x) || !aligned(dx) || (dres && !aligned(dres))) return cudaSuccess;
  SliceLayout s;
  bool ok = false;
  if (cudaError_t err = slice_layout(v, 2, cap, &s, &ok, mask ? 1 : 0)) return err;
  if (!ok) return cudaSuccess;
  const int64_t R = v.rows, C = v.channels;
  const int64_t rpb = s.fits(R) ? s.balanced(R) : s.rpb;
  // Below a tenth of the rows in shared memory the bytes saved no longer pay for the phases with
  // DRAM idle (fold, barriers, merge): H100, session 25, float32 (256,56,56,64), 6.8 %: BN+ReLU
  // 354.7 against 354.3 us, BN+Add+ReLU 432.9 against 430.0; at 13.6 % (bfloat16 (256,56,56,64))
  // 188.8 against 209.9 and 227.5 against 243.4.
  if (10 * s.blocks * rpb < R) return cudaSuccess;
  Split sp = s.split(R, rpb);
  const size_t smem = s.smem(C, rpb);
  auto go = [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) <= 4) {
      int ci = static_cast<int>(C);
      float ef = static_cast<float>(eps);
      void* args[] = {&dy, &x, &mask, &scale, &mean, &var, &dmean, &dvar, &dx, &dres, &sum_dy, &sum_dyxhat, &ws, &coef,
                      &sp, &ci, &ef};
      return launch_resident(hybrid_backward_kernel<T, 16 / sizeof(T)>, s.blocks, smem, s.dev, stream, args,
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
