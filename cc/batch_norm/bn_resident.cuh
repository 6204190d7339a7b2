// Pieces shared by the one-kernel passes of batch_norm: the training forwards bn_resident.cu (x
// wholly in shared memory) and bn_hybrid.cu (a slice of x in shared memory, the rest streamed),
// and the training backward bn_backward_hybrid.cu (a slice of dy and x). All run one block of
// kThreads per SM as a cooperative grid. What only one of them uses stays in its file.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "batch_norm/bn_math.h"
#include "batch_norm/bn_moments.cuh"
#include "batch_norm/bn_test_hooks.h"
#include "batch_norm/bn_view.h"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"

namespace jaxops::batch_norm::resident {

using cuda::from_acc;
using cuda::to_acc;

constexpr int kThreads = 1024;  // one block per SM: its shared memory holds the slice
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChannels = kThreads;

using FMoments = batch_norm::Moments<float>;  // a block's partial of one channel (bn_moments.cuh)

// The shared-memory layout: C coefficient records, the reduction scratch, then the slice.
struct Smem {
  float4* coef;  // {shift, a, b, unused} per channel
  FMoments* red;  // kThreads entries: thread (j, c) at j * C + c
  unsigned char* data;
};

// sm.coef holds channel c at coef_at(c): one float4 of padding every 8. A lane reads the P <= 8
// coefficients of its pack's channels (apply_run, dx_run: P LDS.128, lanes P * 16 bytes apart);
// unpadded, the 8 lanes of a quarter-warp hit the same 4 banks (bf16: 8-way; ncu, session 44:
// 1.89 M of the bf16 hybrid forward's 2.06 M excess shared wavefronts). Padded, lane l's k-th
// read falls in bank group (l + k) mod 8 (P = 8; P = 4 alike): conflict-free. For c = c0 + k with
// c0 a multiple of P and k < P, coef_at(c) = coef_at(c0) + k.
__host__ __device__ constexpr int64_t coef_slots(int64_t C) { return C + C / 8 + 1; }
__device__ __forceinline__ int coef_at(int c) { return c + (c >> 3); }

__host__ __device__ constexpr size_t smem_head(int64_t C) {
  return static_cast<size_t>(coef_slots(C)) * sizeof(float4) + kThreads * sizeof(FMoments);
}

__device__ __forceinline__ Smem smem_layout(int64_t C) {
  extern __shared__ __align__(16) unsigned char bn_res_smem[];
  Smem s;
  s.coef = reinterpret_cast<float4*>(bn_res_smem);
  s.red = reinterpret_cast<FMoments*>(bn_res_smem + coef_slots(C) * sizeof(float4));
  s.data = bn_res_smem + smem_head(C);
  return s;
}

// Folds red[j * C + c] over j < lanes (a power of two) into red[c], in a fixed tree order.
// Every thread of the block must call it (it synchronises).
template <class Fold>
__device__ __forceinline__ void fold_lanes(FMoments* red, int j, int c, int C, int lanes, Fold fold) {
  for (int s = lanes / 2; s > 0; s /= 2) {
    __syncthreads();
    if (j < s) fold(red[j * C + c], red[(j + s) * C + c]);
  }
  __syncthreads();
}

// Whether column_totals' kWarps * C partials of type V fit its scratch (kThreads FMoments records).
template <class V>
__host__ __device__ constexpr bool column_totals_fit(int64_t C) {
  return kWarps * C * sizeof(V) <= kThreads * sizeof(FMoments);
}

// Folds every thread's P partials of its pack column's channels (thread t holds column t % Q,
// channels (t % Q) * P + k, Q = C / P a power of two <= 32, so C is one too) over the block in a
// fixed order and calls done(ch, total) once a channel. The G = 32 / Q lanes of a warp that share
// the column reduce-scatter by xor shuffles: at offsets 16, 8, ... (>= Q) a lane keeps half of
// its channels and adds its partner's half of them, so a warp shuffles P - 1 values instead of
// P log2(G) (the SM shuffles one warp's 32-bit value a cycle: at bfloat16 C = 32 the all-reduce
// took 24 values a warp, 768 cycles a block, twice that for float2 pairs); levels left once a
// lane holds one channel add it outright. The 32 warps' partials go through red (kWarps * C
// values, at w * C + (ch ^ (w % min(C, 32))), so a channel's 32 reads meet no bank conflict;
// column_totals_fit), and warp w totals channels w, w + 32, ... by a shuffle tree. Two block
// barriers where a tree over shared memory takes one a level. Every thread must call it; it
// synchronises first (red's previous readers), but not after done.
template <int P, class V, class Add, class Done>
__device__ __forceinline__ void column_totals(V (&acc)[P], int C, V* red, Add add, Done done) {
  const int Q = C / P, pc = threadIdx.x % Q;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int off = 16, base = 0, held = P;  // acc[0, held) hold channels pc * P + base + i
#pragma unroll
  for (int h = P / 2; h >= 1; h /= 2) {
    if (off >= Q) {  // warp-uniform; once false, false for the smaller h too
      const bool upper = (lane & off) != 0;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const V send = upper ? acc[i] : acc[i + h];
        const V keep = upper ? acc[i + h] : acc[i];
        acc[i] = add(keep, cuda::shfl_xor(send, off));
      }
      base += upper ? h : 0;
      held = h;
      off /= 2;
    }
  }
  // Lanes that differ only in the bits of the remaining offsets hold the same totals: one writes.
  const bool writer = (lane & (2 * off - 1) & ~(Q - 1)) == 0;
  for (; off >= Q; off /= 2) acc[0] = add(acc[0], cuda::shfl_xor(acc[0], off));
  const int swz = (C < 32 ? C : 32) - 1;
  __syncthreads();  // the previous readers of red are done
  if (writer)
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (i < held) red[warp * C + ((pc * P + base + i) ^ (warp & swz))] = acc[i];
  __syncthreads();
  static_assert(kWarps == 32, "the tree gives lane w warp w's partial");
  for (int ch = warp; ch < C; ch += kWarps) {  // warp-uniform
    const V t = cuda::warp_reduce(red[lane * C + (ch ^ (lane & swz))], add);
    if (lane == 0) done(ch, t);
  }
}

// After every channel's coefficients are in coef_g (written by whichever block computed them):
// a grid barrier, then every block loads all C of them into sm.coef. Every thread of the grid
// must call it, and a __syncthreads after it publishes sm.coef.
__device__ __forceinline__ void share_coefficients(const float4* coef_g, const Smem& sm, int C) {
  cooperative_groups::this_grid().sync();
  for (int c = threadIdx.x; c < C; c += kThreads) sm.coef[coef_at(c)] = __ldcg(coef_g + c);
}

// The blocks' partials (ws: (G, 3, C) of shifted sum, shifted mean, M2; G = gridDim.x <= kThreads,
// count(j) block j's rows) merged across the grid: block b merges the channels of rounds b, b + G,
// ... (per channels a round): thread (j, cs) loads block j's partial of channel cs, then a fixed
// tree over j; thread j = 0 writes the channel's mean, var and coefficients (params(c): {pivot,
// scale, bias}, fetched before the partials so the latencies overlap) to mean_out, var_out and
// coef_g. A second grid barrier, then every block loads the C coefficients into sm.coef. The
// alternative, every block folding all partials itself by Chan merges (bn_resident.cu until
// session 67, which sums them instead), took C / lanes of them one after another a thread: at
// C = 256, 33 dependent L2 round trips (H100, session 24: 5 us for this whole merge in
// bn_hybrid.cu, both barriers included). The order of the merges depends only on the grid size.
template <class Count, class Params>
__device__ __forceinline__ void merge_spread(const float* ws, float* __restrict__ mean_out,
                                             float* __restrict__ var_out, float4* coef_g, const Smem& sm, int C,
                                             float eps, Count count, Params params) {
  const int G = gridDim.x;
  int gp = 1;
  while (gp < G) gp *= 2;
  const int per = kThreads / gp;  // channels a round
  const int j = threadIdx.x / per, cs = threadIdx.x % per;
  for (int c0 = blockIdx.x * per; c0 < C; c0 += G * per) {  // block-uniform bounds
    const int c = c0 + cs;
    float4 in = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j == 0 && c < C) in = params(c);
    FMoments v{0.f, 0.f, 0.f, 0.f};
    if (c < C && j < G) {
      const float* p = ws + j * 3 * int64_t(C) + c;  // written in this launch: not through __ldg
      v = FMoments{count(j), __ldcg(p), __ldcg(p + C), __ldcg(p + 2 * C)};
    }
    __syncthreads();  // the previous round's reads of red are done
    sm.red[threadIdx.x] = v;
    fold_lanes(sm.red, j, cs, per, gp, [](FMoments& d, const FMoments& o) { d.merge(o); });
    if (j == 0 && c < C) {
      const FMoments t = sm.red[cs];
      const float mean = t.mean(in.x), var = t.var();
      mean_out[c] = mean;
      var_out[c] = var;
      const Coef<float> q = forward_coef<float>(in.y, in.z, mean, var, eps);
      coef_g[c] = make_float4(q.shift, q.a, q.b, 0.f);
    }
  }
  share_coefficients(coef_g, sm, C);
  __syncthreads();
}

// v = act((v - shift) * a + b (+ r)) in place, and the predicate bits (bit k: value k is
// positive; 0 for k >= valid, the values past the end of the array).
template <class T, int P>
__device__ __forceinline__ uint32_t normalize_pack(T (&v)[P], const T (&r)[P], bool with_res, const float (&sh)[P],
                                                   const float (&a)[P], const float (&b)[P], int valid, bool relu) {
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    float z = (to_acc(v[k]) - sh[k]) * a[k] + b[k];  // the streaming apply's formula (bn_elementwise.cu)
    if (with_res) z += to_acc(r[k]);
    if (relu) {
      const bool pos = z > 0.f && k < valid;
      bits |= static_cast<uint32_t>(pos) << k;
      if (!(z > 0.f || z != z)) z = 0.f;  // NaN propagates like jax.nn.relu
    }
    v[k] = from_acc<T>(z);
  }
  return bits;
}

// Rows of the one-kernel passes with a slice in shared memory: block b keeps rows
// [b * rpb, (b + 1) * rpb) (clipped to R) in shared memory and streams rows
// [S0 + b * spb, S0 + (b + 1) * spb) (clipped), S0 = min(R, gridDim.x * rpb). rpb and spb are
// multiples of q = 32 / gcd(C, 32), so every run starts on a mask word and a 16-byte pack.
struct Split {
  int64_t R, rpb, spb;
  __device__ __forceinline__ int64_t slice_rows(int64_t bk) const { return max(int64_t(0), min(rpb, R - bk * rpb)); }
  __device__ __forceinline__ int64_t span_r0(int64_t bk) const { return min(R, gridDim.x * rpb) + bk * spb; }
  __device__ __forceinline__ int64_t span_rows(int64_t bk) const {
    return max(int64_t(0), min(spb, R - span_r0(bk)));
  }
};

// Host side: the shared-memory slices of a one-kernel pass that keeps the rows of `arrays` arrays
// of v's shape in shared memory (bn_hybrid.cu: x; bn_backward_hybrid.cu: dy and x), one block an
// SM. Every pack a thread reads holds the same P channels only when C / P is a power of two.
struct SliceLayout {
  cuda::DeviceInfo dev;
  int64_t blocks = 0;  // one an SM
  int64_t q = 0;  // rows of a whole mask word and 16-byte pack: 32 / gcd(C, 32)
  int64_t rpb = 0;  // the most rows a block's slice holds, a multiple of q
  size_t row_bytes = 0;  // shared-memory bytes of one slice row

  bool fits(int64_t R) const { return R <= blocks * rpb; }
  // The fewest rows a slice needs to hold all R rows.
  int64_t balanced(int64_t R) const { return cuda::ceil_div(cuda::ceil_div(R, blocks), q) * q; }
  // Slices of `rows` rows (a multiple of q, <= rpb); the spans share the rest.
  Split split(int64_t R, int64_t rows) const {
    const int64_t S = R - std::min(R, blocks * rows);
    return Split{R, rows, cuda::ceil_div(cuda::ceil_div(S, blocks), q) * q};
  }
  size_t smem(int64_t C, int64_t rows) const { return smem_head(C) + static_cast<size_t>(rows) * row_bytes; }
};

// Fills *s and sets *ok where such a pass can run on v: one group of float32 or 16-bit data, C
// in 16-byte packs with C / P a power of two and C <= kMaxChannels, at most kThreads SMs and a
// workspace of at least one slot (`cap`) a block, a slice of at least q rows; not with the
// one-kernel passes turned off (JAXOPS_BN_RESIDENT=0). pack_bytes: bytes a slice row keeps per
// 16-byte pack besides the arrays (the backward's relu bits).
inline cudaError_t slice_layout(const View& v, int arrays, int64_t cap, SliceLayout* s, bool* ok, int pack_bytes = 0) {
  *ok = false;
  const int64_t C = v.channels;
  if (resident_path_disabled() || v.groups != 1 || v.f64 || v.rows < 1 || C < 1 || C > kMaxChannels)
    return cudaSuccess;
  const int64_t esize = v.dtype == Dtype::kF32 ? 4 : 2, P = 16 / esize;
  if (C % P != 0 || ((C / P) & (C / P - 1)) != 0) return cudaSuccess;
  if (cudaError_t err = cuda::device_info(&s->dev)) return err;
  s->blocks = s->dev.sm_count;
  if (s->blocks < 1 || s->blocks > kThreads || cap < s->blocks) return cudaSuccess;
  s->q = 32 / std::gcd<int64_t>(C, 32);
  s->row_bytes = static_cast<size_t>(arrays * C * esize + pack_bytes * C / P);
  const int64_t room = (static_cast<int64_t>(s->dev.max_smem_optin) - static_cast<int64_t>(smem_head(C))) /
                       static_cast<int64_t>(s->row_bytes);
  s->rpb = room / s->q * s->q;
  *ok = s->rpb >= s->q;
  return cudaSuccess;
}

// Whether p is 16-byte aligned. Unlike bn_elementwise.cu's aligned16 this ignores
// JAXOPS_BN_ELEMENT_LOADS: the one-kernel forwards have no element-load twin (the alignment test
// runs with JAXOPS_BN_RESIDENT=0).
inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launches a grid of `blocks` blocks of kThreads, one an SM, as a cooperative launch: it fails
// rather than start a grid whose blocks cannot all be resident at once (the grid barrier would
// wait forever). Host side.
inline cudaError_t launch_cooperative(const void* kernel, int64_t blocks, size_t smem, cudaStream_t stream,
                                      void** args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelExC(&config, kernel, args);
}

// Launches `kernel`, one of the one-kernel passes, on `blocks` blocks (one an SM) if they can all
// be resident at once, and then sets *launched; else launches nothing. Host side. `args` holds the
// addresses of the kernel's arguments; a pointer argument may be given as the address of a void
// pointer (the same bytes).
template <class Kernel>
inline cudaError_t launch_resident(Kernel kernel, int64_t blocks, size_t smem, const cuda::DeviceInfo& dev,
                                   cudaStream_t stream, void** args, bool* launched) {
  if (cuda::resident_clusters(kernel, kThreads, smem, 1, dev) < blocks) return cudaSuccess;
  if (cudaError_t err = launch_cooperative(reinterpret_cast<const void*>(kernel), blocks, smem, stream, args))
    return err;
  *launched = true;
  return cudaSuccess;
}

}  // namespace jaxops::batch_norm::resident
